"""What a compiled TPU program's ``bytes accessed`` is made of, read from libtpu's optimized HLO: which part is HBM.

XLA's cost analysis adds up, instruction by instruction, the bytes of every operand it reads and every output it
writes, wherever the buffer lives. libtpu's memory-space assignment stages buffers through the chip's on-chip
memory (a layout's ``S(1)``; HBM has no ``S(n)``): a weight is copied into it in slices (``slice-start`` /
``slice-done``, joined by a ``ConcatBitcast``) or whole (``copy-start`` / ``copy-done``) and read there by the
matmul; the KV cache is copied in, updated there, copied back. Each such hop is counted again, so ``bytes accessed``
is not what the program moves through HBM, and a decode step's figure can be far above its weights and cache.

:func:`split` re-derives XLA's count from the scheduled HLO libtpu dumps (``LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR``
writes it as ``DIR/<id>-TLP-hlo.txt``) with the rules of XLA's ``HloCostAnalysis`` and the ones libtpu's counts
show for its own instructions, and says which part of it touches HBM:

- parameters, constants, tuple elements and bitcasts move nothing; a tuple counts its index table;
- a slice or dynamic slice reads and writes its output; a dynamic-update-slice reads and writes its update (in place);
- a fusion writes its outputs (a dynamic-update-slice root its update) and reads each parameter as its fused users
  do (a slice of it: the slice; a broadcast or reshape of it: all of it, each time; anything else: once);
- ``copy-start`` reads its operand and writes every leaf of its output (destination, source, context), ``copy-done``
  writes its output; ``slice-start`` reads and writes its slice, ``slice-done`` nothing; ``ConcatBitcast`` writes its
  output; a Mosaic kernel (``tpu_custom_call``) is left out of XLA's total (libtpu records its operands, not its bytes);
- anything else reads its operands and writes its output.

With these rules the total matches libtpu 0.0.52's ``bytes accessed`` to 0.01% on hf_tpu's decode programs of
4096-wide Llamas (1 to 32 layers, v6e and v5e); on tiny models, where tile padding dominates, it is 5-10% short
(some fused slices, scatters and gathers are counted differently there). The HBM part counts, of each of those bytes, the ones whose buffer is in HBM: a DMA
(``copy-start``, ``slice-start``) reads its source and writes its destination once, where each lives, and a Mosaic
kernel reads and writes its HBM operands itself (though XLA's total leaves it out). It is an estimate from the
compiler's placement, not a measurement; docs/planning.md compares it with a chip.

    python -m hf_tpu.tpu_compile.hlo_bytes DIR_OR_FILE [--top N]

prints, for each ``*-TLP-hlo.txt`` (the largest program first), the total, the HBM part, the bytes by kind of
instruction, the entry parameters read from HBM more than once, and the HBM traffic that reads or writes no
parameter (a buffer copied in HBM, an output written whole).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field

from hf_tpu.errors import HfTpuValueError

__all__ = ["Instruction", "Split", "find_dumps", "split"]

_ELEMENT_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
    "u64": 8, "f64": 8, "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "token": 0,
}  # fmt: skip
_MOVES_NOTHING = {"parameter", "constant", "get-tuple-element", "bitcast", "after-all", "add-dependency"}
_MOSAIC = "tpu_custom_call"


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside any bracket."""
    parts, depth, current = [], 0, []
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current))
    return parts


class Shape:
    """An HLO shape with its TPU layout: dimensions, element type, tiling and memory space (0: HBM)."""

    def __init__(self, text: str):
        text = text.strip()
        self.text = text
        self.leaves: list[Shape] | None = None
        if text.startswith("("):
            self.leaves = [Shape(t) for t in _split_top(text[1:-1])]
            return
        m = re.match(r"(\w+)\[([^\]]*)\](\{[^}]*\})?", text)
        if m is None:
            raise HfTpuValueError(f"not an HLO shape: {text!r}")
        self.dtype = m.group(1)
        self.dims = [int(d) for d in m.group(2).split(",") if d.strip()]
        layout = m.group(3) or ""
        space = re.search(r"S\((\d+)\)", layout)
        self.space = int(space.group(1)) if space else 0
        order = re.match(r"\{([\d,]*)", layout)
        self.minor_to_major = [int(x) for x in order.group(1).split(",") if x] if order else []
        tile = re.search(r":T\(([\d,]+)\)", layout)
        self.tile = [int(x) for x in tile.group(1).split(",")] if tile else []

    @property
    def in_hbm(self) -> bool:
        return self.leaves is None and self.space == 0

    def bytes(self) -> int:
        """Its size as XLA counts it: an array padded to its first tile; a tuple, its index table."""
        if self.leaves is not None:
            return 8 * len(self.leaves)
        dims = list(self.dims)
        order = self.minor_to_major or list(range(len(dims)))[::-1]
        for k, size in enumerate(reversed(self.tile)):
            if dims and k < len(order):
                d = order[k]
                dims[d] = -(-dims[d] // size) * size
        return int(math.prod(dims) * _ELEMENT_BYTES.get(self.dtype, 4))


@dataclass
class Instruction:
    """One instruction of the entry computation and what it counts: ``reads`` by operand index, ``writes``."""

    name: str
    opcode: str
    shape: Shape
    operands: list[str]
    target: str | None = None
    calls: str | None = None
    index: int | None = None  # a parameter's number
    root: bool = False
    reads: dict[int, float] = field(default_factory=dict)
    writes: float = 0.0
    hbm: float = 0.0
    parameter_hbm: float = 0.0  # the part of ``hbm`` that reads an entry parameter

    @property
    def kind(self) -> str:
        return self.target if self.opcode == "custom-call" and self.target else self.opcode

    @property
    def counted(self) -> float:
        """Its part of XLA's ``bytes accessed`` (0 for a Mosaic kernel: see the module doc)."""
        return 0.0 if self.target == _MOSAIC else sum(self.reads.values()) + self.writes


def _parse_instruction(line: str) -> Instruction:
    line = line.strip()
    root = line.startswith("ROOT ")
    if root:
        line = line[5:]
    name, rest = line.split(" = ", 1)
    if rest.startswith("("):
        depth = 0
        for end, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        shape_text, rest = rest[: end + 1], rest[end + 1 :].strip()
    else:
        shape_text, rest = rest.split(" ", 1)
    m = re.match(r"([\w-]+)\(", rest)
    opcode, start = m.group(1), m.end() - 1
    depth = 0
    for end in range(start, len(rest)):
        depth += rest[end] == "("
        depth -= rest[end] == ")"
        if depth == 0:
            break
    inside, attrs = rest[start + 1 : end], rest[end + 1 :]
    operands = [re.sub(r"^.*%", "", o.strip()) for o in _split_top(inside) if "%" in o]
    calls = re.search(r"calls=%([\w.\-]+)", attrs)
    target = re.search(r'custom_call_target="([^"]+)"', attrs)
    return Instruction(
        name=name.lstrip("%"), opcode=opcode, shape=Shape(shape_text), operands=operands, root=root,
        target=target.group(1) if target else None, calls=calls.group(1) if calls else None,
        index=int(inside) if opcode == "parameter" and inside.strip().isdigit() else None,
    )  # fmt: skip


def parse(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """The computations of an HLO module's text (name -> instructions) and the entry computation's name."""
    text = re.sub(r"/\*.*?\*/", "", text)
    computations: dict[str, list[Instruction]] = {}
    current, entry = None, None
    for line in text.splitlines():
        if line.startswith("%") or line.startswith("ENTRY"):
            name = re.match(r"(?:ENTRY )?%([\w.\-]+)", line).group(1)
            current = computations[name] = []
            if line.startswith("ENTRY"):
                entry = name
        elif line.startswith("}"):
            current = None
        elif current is not None and " = " in line:
            current.append(_parse_instruction(line))
    if entry is None:
        raise HfTpuValueError("no ENTRY computation in this HLO text")
    return computations, entry


class _Counter:
    def __init__(self, computations: dict[str, list[Instruction]]):
        self.computations = computations
        self.by_name = {c: {i.name: i for i in body} for c, body in computations.items()}

    def parameter_reads(self, computation: str, param: Instruction) -> float:
        """Bytes a fused computation reads of one of its parameters (XLA's ``FusionParameterReadBytes``)."""
        size, seen = 0.0, False
        for user in (i for i in self.computations[computation] if param.name in i.operands):
            if user.opcode == "fusion":
                for k, operand in enumerate(user.operands):
                    if operand == param.name:
                        inner = next(p for p in self.computations[user.calls] if p.index == k)
                        size += self.parameter_reads(user.calls, inner)
            elif user.opcode == "slice":
                size += user.shape.bytes()
            elif user.opcode == "dynamic-slice":
                if user.operands[0] == param.name:
                    size += user.shape.bytes()
                elif not seen:
                    seen, size = True, size + param.shape.bytes()
            elif user.opcode == "dynamic-update-slice":
                if user.operands[0] != param.name and not seen:
                    seen, size = True, size + param.shape.bytes()
            elif user.opcode in ("broadcast", "reshape"):
                size += param.shape.bytes()
            elif not seen:
                seen, size = True, size + param.shape.bytes()
        return size

    def count(self, computation: str, ins: Instruction) -> None:
        names = self.by_name[computation]
        ops = [names[o] for o in ins.operands if o in names]
        kind = ins.kind
        if ins.opcode in _MOVES_NOTHING:
            return
        if ins.opcode == "tuple":
            ins.writes = ins.shape.bytes()
        elif ins.opcode in ("slice", "dynamic-slice"):
            ins.reads = {0: ins.shape.bytes(), **{k: o.shape.bytes() for k, o in enumerate(ops) if k}}
            ins.writes = ins.shape.bytes()
        elif ins.opcode == "dynamic-update-slice":
            ins.reads = {0: 0, **{k: o.shape.bytes() for k, o in enumerate(ops) if k}}
            ins.writes = ops[1].shape.bytes()
        elif ins.opcode == "fusion":
            body = self.computations[ins.calls]
            inner = {i.name: i for i in body}
            root = next(i for i in body if i.root)
            outs = [inner[o] for o in root.operands] if root.opcode == "tuple" else [root]
            ins.writes = sum(
                inner[o.operands[1]].shape.bytes() if o.opcode == "dynamic-update-slice" else o.shape.bytes() for o in outs
            )  # fmt: skip
            ins.reads = {p.index: self.parameter_reads(ins.calls, p) for p in body if p.opcode == "parameter"}
        elif kind == "copy-start":
            ins.reads = {0: ops[0].shape.bytes()}
            ins.writes = sum(leaf.bytes() for leaf in ins.shape.leaves or [ins.shape])
        elif kind in ("copy-done", "ConcatBitcast"):
            ins.writes = ins.shape.bytes()
        elif kind == "slice-start":
            piece = ins.shape.leaves[1].bytes()
            ins.reads, ins.writes = {0: piece}, piece
        elif kind == "slice-done":
            pass
        else:
            ins.reads = {k: o.shape.bytes() for k, o in enumerate(ops)}
            ins.writes = ins.shape.bytes()
        ins.hbm = self.hbm(ins, ops)

    @staticmethod
    def hbm(ins: Instruction, ops: list[Instruction]) -> float:
        """The part of the instruction's bytes whose buffer is in HBM (see the module doc)."""
        kind = ins.kind
        if kind == "copy-start":
            source, destination = ops[0].shape, ins.shape.leaves[0]
            return (source.bytes() if source.in_hbm else 0) + (destination.bytes() if destination.in_hbm else 0)
        if kind == "copy-done":
            return 0.0  # the DMA is counted at its start
        if kind == "slice-start":
            piece = ins.shape.leaves[1]
            return ins.reads[0] * ops[0].shape.in_hbm + piece.bytes() * piece.in_hbm
        total = sum(v for k, v in ins.reads.items() if k < len(ops) and ops[k].shape.in_hbm)
        if ins.shape.leaves is None:
            total += ins.writes if ins.shape.in_hbm else 0
        elif ins.opcode == "fusion" and ins.writes:
            leaves = ins.shape.leaves
            whole = sum(leaf.bytes() for leaf in leaves) or 1
            total += ins.writes * sum(leaf.bytes() for leaf in leaves if leaf.in_hbm) / whole
        return total


@dataclass
class Split:
    """A program's ``bytes accessed`` as XLA counts it, the part of it in HBM, and where both come from."""

    bytes_accessed: float
    hbm_bytes: float
    instructions: list[Instruction]
    parameter_bytes: dict[str, int]  # entry parameter -> its size
    parameter_hbm_reads: dict[str, float]  # entry parameter -> bytes read of it from HBM

    def by_kind(self) -> dict[str, tuple[float, float, int]]:
        """Instruction kind -> (counted bytes, HBM bytes, instructions); fusions split by whether they read >4 MB."""
        rows: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0])
        for ins in self.instructions:
            kind = ins.kind
            if ins.opcode == "fusion":
                kind = "fusion reading a weight" if max(ins.reads.values(), default=0) > 4e6 else "fusion (small)"
            row = rows[kind]
            row[0] += ins.counted
            row[1] += ins.hbm
            row[2] += 1
        return {k: tuple(v) for k, v in rows.items()}

    def parameters_read_more_than_once(self) -> dict[str, float]:
        """Entry parameters read from HBM more than their size (by more than 1%): name -> bytes read."""
        return {p: read for p, read in self.parameter_hbm_reads.items() if read > 1.01 * self.parameter_bytes[p] + 1e5}

    def other_hbm(self) -> float:
        """HBM bytes that are no read of an entry parameter: buffers copied in HBM, outputs written."""
        return self.hbm_bytes - sum(self.parameter_hbm_reads.values())


def split(text: str) -> Split:
    """Split the optimized HLO ``text`` of one program (libtpu's ``*-TLP-hlo.txt``); see the module doc."""
    computations, entry = parse(text)
    counter = _Counter(computations)
    body = computations[entry]
    for ins in body:
        counter.count(entry, ins)
    names = counter.by_name[entry]

    def source(name: str) -> str:
        while names[name].opcode == "bitcast":
            name = names[name].operands[0]
        return name

    params = {i.name: i.shape.bytes() for i in body if i.opcode == "parameter"}
    reads: dict[str, float] = defaultdict(float)
    for ins in body:
        ops = [o for o in ins.operands if o in names]
        for k, value in ins.reads.items():
            if k >= len(ops) or ins.kind in ("copy-done",):
                continue
            origin = source(ops[k])
            if origin in params and names[ops[k]].shape.in_hbm:
                reads[origin] += value
                ins.parameter_hbm += value
    return Split(
        bytes_accessed=sum(i.counted for i in body), hbm_bytes=sum(i.hbm for i in body), instructions=body,
        parameter_bytes=params, parameter_hbm_reads=dict(reads),
    )  # fmt: skip


def find_dumps(path: str) -> list[str]:
    """The scheduled-HLO files of a libtpu dump folder (``*-TLP-hlo.txt``), the largest first; or ``[path]``."""
    if os.path.isfile(path):
        return [path]
    files = glob.glob(os.path.join(path, "**", "*-TLP-hlo.txt"), recursive=True)
    return sorted(files, key=os.path.getsize, reverse=True)


def _mb(n: float) -> str:
    return f"{n / 1e6:10.1f} MB"


def report(result: Split, top: int = 12) -> str:
    """A few lines a person reads: totals, bytes by kind, parameters read twice, other HBM traffic."""
    lines = [
        f"bytes accessed (XLA's rules){_mb(result.bytes_accessed)}",
        f"  of which in HBM           {_mb(result.hbm_bytes)}",
        f"  entry parameters read from HBM {_mb(sum(result.parameter_hbm_reads.values()))} "
        f"(of {_mb(sum(result.parameter_bytes.values())).strip()} of parameters)",
        f"  other HBM traffic         {_mb(result.other_hbm())}",
        "",
        f"{'instruction kind':<34}{'count':>6}{'counted':>14}{'in HBM':>14}",
    ]
    for kind, (counted, hbm, n) in sorted(result.by_kind().items(), key=lambda kv: -kv[1][0])[:top]:
        if counted > 1e5 or hbm > 1e5:
            lines.append(f"{kind:<34}{n:>6}{_mb(counted):>14}{_mb(hbm):>14}")
    twice = result.parameters_read_more_than_once()
    lines.append("")
    lines.append(f"parameters read from HBM more than once: {len(twice)}")
    for name, read in sorted(twice.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {name}: {_mb(read).strip()} read of {_mb(result.parameter_bytes[name]).strip()}")
    other: dict[tuple[str, str], float] = defaultdict(float)
    for ins in result.instructions:
        rest = ins.hbm - ins.parameter_hbm
        if rest > 0:
            other[(ins.kind, (ins.shape.leaves[0] if ins.shape.leaves else ins.shape).text)] += rest
    lines.append("HBM traffic besides reading the parameters (kind, shape):")
    for (kind, shape), value in sorted(other.items(), key=lambda kv: -kv[1])[:top]:
        if value > 1e5:
            lines.append(f"  {kind:<14} {shape[:64]:<64} {_mb(value)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_tpu.tpu_compile.hlo_bytes", description=__doc__.split("\n")[0])
    parser.add_argument(
        "path", help="a libtpu dump folder (LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR) or one *-TLP-hlo.txt"
    )
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    files = find_dumps(args.path)
    if not files:
        print(f"{args.path}: no *-TLP-hlo.txt (compile with LIBTPU_INIT_ARGS=--xla_jf_dump_to={args.path})")
        return 2
    for path in files:
        text = open(path).read()
        module = re.match(r"HloModule (\S+?),", text)
        print(f"== {os.path.basename(path)} ({module.group(1) if module else '?'})")
        print(report(split(text), args.top))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
