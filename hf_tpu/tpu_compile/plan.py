"""``hf-tpu plan``'s engine: what a TPU would spend on a model's ``generate``, from libtpu's compiler, on any host.

:func:`plan_generate` builds the model from its config with deferred weights (no weights read, no memory: a 70B
config plans on a laptop), checks that the weights and KV cache can fit the target's HBM at all (if not, it says so
with the numbers and compiles nothing), then lowers the prefill and decode programs of hf_tpu's warm-up and compiles
them for the target (:func:`hf_tpu.tpu_compile.lower_and_compile`). The :class:`Plan` says whether it fits (weights,
KV cache, the largest program's temporaries and outputs not aliased to an input), the compile time per program,
the decode step's projected time and tokens/s, and how close the step is to its floor (the weights and KV cache
read once). It fits only when every program compiled within the HBM; a program libtpu refused for HBM makes it
``"does not fit"`` (named, with the bytes it needed, and what would fit), any other failure ``"could not plan"``
(:attr:`Plan.verdict`, :attr:`Plan.exit_status`: ``hf-tpu plan``'s 0, 3 or 1).

Every projected time is an estimate, not a measurement. A program's: XLA's ``bytes accessed`` over the chip's
published HBM bandwidth, or its FLOPs over the published peak, whichever is longer (XLA's own ``optimal_seconds``
where it gives one): the compiler's counts with default options, not torch_tpu's exact build flags. The decode
step's: the bytes the step must read from HBM (its floor: the weights, for a MoE only the share of the experts a
batch of random tokens routes to, and the KV cache) at the streaming rate a chip reaches (:data:`STREAMING`, measured
on a v5e), or its FLOPs over the peak, whichever is longer. Checked on a TPU v5e (docs/planning.md, "Measured on a
chip"): XLA's bytes accessed projected a Llama-3.2-1B-shaped decode at 2.5x its measured time (the count includes
on-chip copies); the floor at the measured rate came within 7% of it, and within 15% of a Qwen3-30B-A3B-shaped MoE
decode's (batch 1). At batch 8 and 64 hf_tpu's decode programs ran 1.25x to 2.8x that projection (each step copies
the KV caches: torch_tpu 0.2.0 donates no buffers to its compiled graphs; see there). With ``dump_hlo`` the step's
HBM traffic in libtpu's placement is known, and the projection streams it where it exceeds the floor: the batch-64
Llama decode then projects 11.0 ms of a measured 14.1 (-22%; the floor: 5.09 ms), batch 8 4.80 of 4.40 ms, batch 1
3.39 of 3.58 ms.

Example:
    >>> from hf_tpu.tpu_compile.plan import plan_generate                             # doctest: +SKIP
    >>> plan = plan_generate("llama-8b-config/", "v6e-1", max_prompt_len=2048, max_new_tokens=256)   # doctest: +SKIP
    >>> print(plan.table())                                                           # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hf_tpu.errors import UserError
from hf_tpu.tpu_compile.programs import LoweringResult, ProgramRecord, lower_and_compile, lower_and_compile_each
from hf_tpu.tpu_compile.targets import Target, target as find_target

#: The share of its published HBM bandwidth a TPU streams a decode step's bytes at: on a v5e a bf16 reduction and a
#: matrix-vector product over 2.5 GB ran at 749 and 745 GB/s of 819 (scripts/chip_bench.py, docs/chip_v5e.json).
STREAMING = 749 / 819

__all__ = ["EXIT_COULD_NOT_PLAN", "EXIT_DOES_NOT_FIT", "EXIT_FITS", "EXIT_USAGE", "MissingPackageError", "Plan",
           "out_of_memory", "plan_generate", "plan_generate_each", "plan_pipeline", "require_packages"]

GENERATE_ENTRY = "hf_tpu.tpu_compile._generate:lower_generate"
GB = 1e9

#: ``hf-tpu plan``'s exit statuses: every program the run needs compiled within the target's HBM; it could not be
#: planned (a program failed to lower or compile for a reason other than memory, a package missing); bad command
#: line or input (argparse's and hf-tpu's usual 2); it does not fit (weights and KV cache, or a program's HBM).
EXIT_FITS, EXIT_COULD_NOT_PLAN, EXIT_USAGE, EXIT_DOES_NOT_FIT = 0, 1, 2, 3

# libtpu's refusal of a program that needs more HBM than the device has (libtpu 0.0.52, the 8B shape's prefill on
# v5e-1): "JaxRuntimeError: RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory
# required for HLO temporaries (16.63G) exceeds available HBM (15.75G). ..." (G: GiB)
_OOM = re.compile(r"CompileTimeHbmOom|RESOURCE_EXHAUSTED|[Rr]an out of memory")
_USED = re.compile(r"\((?P<used>[\d.]+)(?P<u1>[KMGT]?)\) exceeds available HBM \((?P<cap>[\d.]+)(?P<u2>[KMGT]?)\)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class MissingPackageError(UserError, ImportError):
    """A package the plan needs is not installed (torch-tpu for any plan, torchao for int8/int4 weights): the
    message names the extra to install; nothing was planned."""


def require_packages(quantization: str | None = None) -> None:
    """Raise :class:`MissingPackageError` naming the extra to install when torch-tpu (with libtpu and jax) or, for
    ``quantization`` int8/int4, torchao is missing: found here, before any process is started."""
    import importlib.util

    missing = [name for name in ("torch_tpu", "libtpu", "jax") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingPackageError(
            f"compiling for a TPU needs torch-tpu, libtpu and jax ({', '.join(missing)} not installed here): pip "
            "install 'hf-tpu[tpu]' (torch==2.13.0 first). Nothing was planned."
        )
    if quantization in ("int8", "int4") and importlib.util.find_spec("torchao") is None:
        raise MissingPackageError(
            f"--quantization {quantization} quantizes the weights with torchao, which is not installed here: pip "
            "install 'hf-tpu[quant]' (torchao 0.18). Nothing was planned."
        )


def out_of_memory(program: ProgramRecord) -> dict[str, float] | None:
    """Whether libtpu refused ``program`` for HBM: ``{"needed": bytes, "available": bytes}`` (0 where its message
    gave no figures), else None."""
    if program.compiled or not program.error or not _OOM.search(program.error):
        return None
    used = _USED.search(program.error)
    if used is None:
        return {"needed": 0.0, "available": 0.0}
    return {"needed": float(used["used"]) * _UNITS[used["u1"]], "available": float(used["cap"]) * _UNITS[used["u2"]]}


def human(n: float) -> str:
    """Bytes in the unit that reads best: ``16.06 GB``, ``302.0 MB``, ``107.2 kB``."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass
class Plan:
    """A plan for one model, call size and target (see the module doc); :meth:`to_dict` is ``--json``'s object.

    Attributes:
        target: the :class:`~hf_tpu.tpu_compile.Target` planned for.
        model: the model (or pipeline) directory or config file planned.
        fits: whether every program compiled and weights, KV cache and each program's HBM fit the device's (False
            when it does not fit and when it could not be planned: :attr:`verdict` tells them apart).
        does_not_fit: known not to fit: the weights and KV cache exceed the device's HBM, libtpu refused a program
            for HBM, or the total exceeds it.
        out_of_memory: the programs libtpu refused for HBM: name -> ``{"needed", "available"}`` bytes (its figures).
        suggestions: what would fit, estimated from the bytes (a smaller prompt bucket or batch, int8, more chips).
        hbm: the HBM budget in bytes: ``capacity``, ``weights``, ``kv_cache`` (0 for a pipeline),
            ``temporaries``, ``total``.
        programs: one :class:`~hf_tpu.tpu_compile.ProgramRecord` per program.
        info: facts about the model and the call (parameters, dtype, buckets, batch, ...).
        note: why nothing was lowered (the weights alone exceed HBM) and what to do, else None.
        error: why the plan failed (the entry's error, or no program compiled), else None.
        kind: ``"generate"`` (:func:`plan_generate`) or ``"pipeline"`` (:func:`plan_pipeline`).
    """

    target: Target
    model: str
    fits: bool
    hbm: dict[str, int]
    programs: list[ProgramRecord]
    info: dict[str, Any] = field(default_factory=dict)
    note: str | None = None
    error: str | None = None
    kind: str = "generate"  # or "pipeline": a diffusers pipeline's denoiser step (plan_pipeline)
    does_not_fit: bool = False
    out_of_memory: dict[str, dict[str, float]] = field(default_factory=dict)
    suggestions: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """``"fits"``, ``"does not fit"`` (known: the weights and KV cache, or a program's HBM, exceed the device's)
        or ``"could not plan"`` (a program failed for another reason, or the entry did; ``error`` says why)."""
        if self.does_not_fit:
            return "does not fit"
        return "fits" if self.fits else "could not plan"

    @property
    def exit_status(self) -> int:
        """``hf-tpu plan``'s exit status: :data:`EXIT_FITS`, :data:`EXIT_DOES_NOT_FIT` or
        :data:`EXIT_COULD_NOT_PLAN`."""
        return {"fits": EXIT_FITS, "does not fit": EXIT_DOES_NOT_FIT}.get(self.verdict, EXIT_COULD_NOT_PLAN)

    def _decode(self) -> ProgramRecord | None:
        if self.kind != "generate":
            return None
        decodes = [p for p in self.programs if p.name.startswith("decode") and p.compiled]
        return max(decodes, key=lambda p: p.argument_bytes) if decodes else None

    def step_seconds(self, program: ProgramRecord) -> float | None:
        """The projected seconds of one run of ``program`` on the target (an estimate; see the module doc).

        Args:
            program: one of :attr:`programs`.

        Returns:
            libtpu's optimal-seconds estimate when it gave one, else the larger of bytes accessed over the target's
            HBM bandwidth and flops over its peak; None when the program did not compile.
        """
        if not program.compiled:
            return None
        if program.optimal_seconds is not None and program.optimal_seconds > 0:
            return program.optimal_seconds
        return max(program.bytes_accessed / self.target.hbm_bandwidth, program.flops / self.target.peak_flops)

    def decode_floor_bytes(self) -> int:
        """Bytes a decode step must read from HBM: the weights (the input embedding's table left out when it is
        gathered, not the head), for a MoE only the experts ``batch`` random tokens are expected to route to
        (``E x (1 - (1 - k/E)^batch)`` of each layer's E), and the KV cache.

        Returns:
            The floor in bytes, an int.
        """
        info = self.info
        floor = self.hbm["weights"] - int(info.get("gathered_embedding_bytes", 0)) + self.hbm["kv_cache"]
        experts, top_k, experts_bytes = info.get("num_experts"), info.get("top_k"), int(info.get("experts_bytes", 0))
        if experts_bytes and experts and top_k:
            routed = 1 - (1 - top_k / experts) ** int(info.get("batch", 1))
            floor -= int(experts_bytes * (1 - routed))
        return floor

    def decode_summary(self) -> dict[str, Any] | None:
        """The decode step: projected ms and tokens/s, bytes moved, and bytes over its floor (weights + KV once).

        Returns:
            A dict (``program``, ``projected_ms``, ``projected_tokens_per_second``,
            ``projected_ms_from_bytes_accessed``, ``bytes_accessed``, ``floor_bytes``, ``bytes_over_floor``;
            ``flops`` (XLA's), ``matmul_flops`` (2 x the parameters multiplied x batch) and ``flops_over_matmul``;
            and the HBM figures with ``dump_hlo``) for the largest compiled decode program; None for a pipeline plan
            or when no decode program compiled.
        """
        decode = self._decode()
        if decode is None:
            return None
        floor = self.decode_floor_bytes()
        # With libtpu's placement (dump_hlo) the step's HBM traffic is known: the cache's copy in every step (no
        # donated buffers) and the rest of what the floor leaves out; the projection streams the larger of the two.
        streamed = max(floor, decode.hbm_bytes or 0)
        seconds = max(streamed / (self.target.hbm_bandwidth * STREAMING), decode.flops / self.target.peak_flops)
        batch = int(self.info.get("batch", 1))
        summary = {
            "program": decode.name,
            "projected_from": "hbm_bytes" if decode.hbm_bytes and decode.hbm_bytes > floor else "floor_bytes",
            "projected_ms": seconds * 1e3,
            "projected_tokens_per_second": batch / seconds if seconds else None,
            "projected_ms_from_bytes_accessed": self.step_seconds(decode) * 1e3,
            "bytes_accessed": decode.bytes_accessed,
            "floor_bytes": floor,
            "bytes_over_floor": decode.bytes_accessed / floor if floor else None,
        }
        # A token's matrix products: 2 x the parameters it multiplies (the input embedding is a gather) x the batch.
        # XLA's own count is about 2.5x that at batch 1: libtpu rewrites a product with one row (a matrix-vector
        # product) as elementwise converts and a multiply then a reduction, and counts each of those 5 elementwise
        # ops per weight (docs/planning.md); from 2 rows on it is a matrix product again, counted 2 per weight.
        params = int(self.info.get("parameters", 0)) - int(self.info.get("gathered_embedding_parameters", 0))
        if params > 0:
            summary["matmul_flops"] = 2.0 * params * batch
            summary["flops"] = decode.flops
            summary["flops_over_matmul"] = decode.flops / summary["matmul_flops"]
        if decode.hbm_bytes is not None:  # --dump-hlo: the part of bytes_accessed that is HBM traffic
            hbm_seconds = max(decode.hbm_bytes / (self.target.hbm_bandwidth * STREAMING),
                              decode.flops / self.target.peak_flops)  # fmt: skip
            summary.update(
                hbm_bytes=decode.hbm_bytes, hbm_over_floor=decode.hbm_bytes / floor if floor else None,
                projected_ms_from_hbm=hbm_seconds * 1e3,
            )  # fmt: skip
        return summary

    def step_summary(self) -> dict[str, Any] | None:
        """A pipeline's denoiser step: projected ms per step, bytes moved, and bytes over its floor (the denoiser's
        weights, read once per step); None for a generate plan or when nothing compiled.

        Returns:
            A dict (``programs``, ``projected_ms``, ``bytes_accessed``, ``floor_bytes``, ``bytes_over_floor``,
            ``flops``, and ``hbm_bytes`` with ``dump_hlo``) summed over the compiled programs, or None.
        """
        steps = [p for p in self.programs if p.compiled] if self.kind == "pipeline" else []
        if not steps:
            return None
        seconds = sum(self.step_seconds(p) for p in steps)
        moved = sum(p.bytes_accessed for p in steps)
        floor = int(self.info.get("denoiser_bytes", 0))
        summary = {
            "programs": [p.name for p in steps],
            "projected_ms": seconds * 1e3,
            "bytes_accessed": moved,
            "floor_bytes": floor,
            "bytes_over_floor": moved / floor if floor else None,
            "flops": sum(p.flops for p in steps),
        }
        if all(p.hbm_bytes is not None for p in steps):
            summary["hbm_bytes"] = sum(p.hbm_bytes for p in steps)
        return summary

    def to_dict(self) -> dict[str, Any]:
        """The plan as ``hf-tpu plan --json`` prints it.

        Returns:
            A JSON-serializable dict: target, model, fits, HBM bytes, each program's record, the decode or step
            summary, info, note and error.
        """
        return {
            "target": self.target.name,
            "model": self.model,
            "fits": self.fits,
            "verdict": self.verdict,
            "exit_status": self.exit_status,
            "out_of_memory": self.out_of_memory,
            "suggestions": self.suggestions,
            "hbm_bytes": dict(self.hbm),
            "programs": [p.to_dict() for p in self.programs],
            "decode": self.decode_summary(),
            "step": self.step_summary(),
            "kind": self.kind,
            "estimate": "projected figures are estimates from libtpu's compiler counts, not measurements",
            "info": self.info,
            "note": self.note,
            "error": self.error,
        }

    def _beyond_parts(self) -> list[str]:
        """The line that makes ``total`` the sum of the lines above it when it is not (a program libtpu refused
        needs more than weights, KV cache and the compiled programs' temporaries; or a program's peak does)."""
        hbm = self.hbm
        rest = hbm["total"] - hbm["weights"] - hbm.get("kv_cache", 0) - hbm["temporaries"]
        if rest <= 0:
            return []
        refused = ", ".join(self.out_of_memory) if getattr(self, "out_of_memory", None) else ""
        why = (f"{refused}: libtpu's figure for what it needed, past the parts above" if refused
               else "a program's peak, past the parts above")  # fmt: skip
        return [f"  more needed  {human(rest)}  ({why})"]

    def table(self) -> str:
        """The plan as a few lines of text (what ``hf-tpu plan`` prints).

        Returns:
            The text, lines joined by newlines.
        """
        gb = human
        info = self.info
        if self.kind == "pipeline":
            call = f"batch {info.get('batch')}, {info.get('height')}x{info.get('width')}, denoiser " + ", ".join(
                info.get("denoisers", [])
            )
        else:
            call = (
                f"batch {info.get('batch')}, prompt {info.get('max_prompt_len')} (bucket {info.get('prompt_bucket')}), "
                f"{info.get('max_new_tokens')} new tokens"
            )
        lines = [
            f"{self.model}: {info.get('model_type', '?')}, {info.get('parameters', 0) / 1e9:.3g}B parameters, "
            f"{info.get('dtype', '?')}{', ' + info['quantization'] if info.get('quantization') else ''}; {call}",
            f"target {self.target.describe()}",
            "",
            f"HBM per device: {gb(self.hbm['capacity'])}",
            f"  weights      {gb(self.hbm['weights'])}" + ("  (every component)" if self.kind == "pipeline" else ""),
            *([] if self.kind == "pipeline" else [f"  KV cache     {gb(self.hbm['kv_cache'])}"]),
            f"  temporaries  {gb(self.hbm['temporaries'])}  (largest program's temps and outputs not aliased)",
            *self._beyond_parts(),
            f"  total        {gb(self.hbm['total'])}  -> {self.verdict.upper()} "
            f"(headroom {gb(self.hbm['capacity'] - self.hbm['total'])})",
        ]
        for name, oom in self.out_of_memory.items():
            figures = f": needs {gb(oom['needed'])} of {gb(oom['available'])}" if oom["needed"] else ""
            lines.append(f"  {name} is out of HBM{figures} (libtpu refused to compile it)")
        if self.note:
            lines += ["", self.note]
        if self.suggestions:
            lines += ["", "what would fit (estimates from these bytes: plan again to check):"]
            lines += [f"  - {s}" for s in self.suggestions]
        if self.programs:
            lines += ["", f"{'program':<16}{'lowered':>9}{'compiled':>10}{'lower s':>9}{'compile s':>11}"
                          f"{'GFLOP':>13}{'GB moved':>11}{'temp MB':>10}{'est. ms':>10}"]  # fmt: skip
            for p in self.programs:
                seconds = self.step_seconds(p)
                lines.append(
                    f"{p.name:<16}{'yes' if p.lowered else 'NO':>9}{'yes' if p.compiled else 'NO':>10}"
                    f" {(p.lower_seconds or 0):>8.1f} {(p.compile_seconds or 0):>10.1f}"
                    f" {(p.flops or 0) / 1e9:>12.3f} {(p.bytes_accessed or 0) / GB:>10.3f}"
                    f" {(p.temp_bytes or 0) / 1e6:>9.1f} {(seconds * 1e3 if seconds else 0):>9.3f}"
                )
                if p.error:
                    lines.append(f"    {p.error.splitlines()[0][:200]}" + (f"  [{p.where}]" if p.where else ""))
            total = sum((p.lower_seconds or 0) + (p.compile_seconds or 0) for p in self.programs)
            lines.append(f"compile time, all programs: {total:.1f} s here (lowering on this host + libtpu)")
        summary = self.decode_summary()
        if summary:
            lines += [
                "",
                f"decode step (an estimate, not a measurement: its "
                f"{'HBM traffic' if summary['projected_from'] == 'hbm_bytes' else 'floor'} at the chip's streaming "
                f"rate): "
                f"{summary['projected_ms']:.3f} ms, {summary['projected_tokens_per_second']:.0f} tokens/s at batch "
                f"{info.get('batch')}",
                f"  its floor (the weights but the input embeddings, a MoE's routed experts only, and the KV cache, "
                f"read once) is {human(summary['floor_bytes'])}; XLA's bytes accessed "
                f"{human(summary['bytes_accessed'])}"
                f" ({summary['bytes_over_floor']:.2f}x the floor, on-chip copies counted too: "
                f"{summary['projected_ms_from_bytes_accessed']:.3f} ms at the HBM bandwidth)",
            ]
            if "matmul_flops" in summary:
                lines.append(
                    f"  {summary['flops'] / 1e9:.1f} GFLOP by XLA's count, {summary['flops_over_matmul']:.2f}x the "
                    f"token's matrix products ({summary['matmul_flops'] / 1e9:.1f} GFLOP: 2 x parameters x batch; at batch 1 "
                    "libtpu computes a matrix-vector product as elementwise ops and counts 5 per weight, not 2)"
                )
            if "hbm_bytes" in summary:
                lines.append(
                    f"  of which HBM traffic (libtpu's placement, --dump-hlo) {human(summary['hbm_bytes'])}: "
                    f"{summary['hbm_over_floor']:.2f}x the floor, {summary['projected_ms_from_hbm']:.3f} ms at the "
                    f"chip's streaming rate"
                )
            elif int(info.get("batch", 1) or 1) > 1:
                lines.append(
                    "  at batch > 1 a step also copies its KV caches (no donated buffers in torch_tpu 0.2.0), which "
                    "the floor leaves out: --dump-hlo projects from libtpu's HBM traffic instead"
                )
        step = self.step_summary()
        if step:
            lines += [
                "",
                f"denoiser step (estimate from the compiler's counts, not a measurement): {step['projected_ms']:.3f} ms "
                f"per step, {step['flops'] / 1e12:.2f} TFLOP",
                f"  moves {human(step['bytes_accessed'])}; the denoiser's weights are {human(step['floor_bytes'])}"
                + (f": {step['bytes_over_floor']:.2f}x" if step["bytes_over_floor"] else ""),
            ]
            if "hbm_bytes" in step:
                lines.append(f"  of which HBM traffic (--dump-hlo) {human(step['hbm_bytes'])}")
        if self.error:
            lines += ["", f"error: {self.error}"]
        return "\n".join(lines)


def plan_generate(
    model: str | os.PathLike,
    target: str = "v6e-1",
    *,
    batch: int = 1,
    max_prompt_len: int = 2048,
    max_new_tokens: int = 256,
    dtype: str | None = "bfloat16",
    quantization: str | None = None,
    buckets: str = "largest",
    generation: dict | None = None,
    progress: Callable[[str], None] | None = None,
    dump_hlo: str | os.PathLike | None = None,
) -> Plan:
    """Plan ``model``'s ``generate`` on ``target``: fit, compile times, projected decode step (see the module doc).

    Args:
        model: a model directory or its ``config.json`` (no weights are read).
        target: a name of :data:`hf_tpu.tpu_compile.TARGETS` (``"v6e-1"``).
        batch, max_prompt_len, max_new_tokens: the call size, as ``hf_tpu.warmup`` takes it.
        dtype: the weights' dtype (``"bfloat16"``); None keeps the config's.
        quantization: ``"int8"`` or ``"int4"`` weight-only (torchao, as ``TorchAoConfig`` with hf_tpu), ``"fp8"`` (a
            fine-grained fp8 checkpoint's layout, 128x128 blocks); None.
        buckets: ``"largest"`` compiles the bucket of ``max_prompt_len`` only; ``"all"`` every bucket warm-up would.
        generation: generation_config fields to set first (``{"do_sample": True, "top_k": 50}``).
        progress: called with a line of progress as programs lower and compile.
        dump_hlo: a folder to keep libtpu's scheduled HLO of each program in (``<name>.hlo.txt``); the decode
            summary then also says how much of its bytes accessed is HBM traffic, and projects the step from it
            where it exceeds the floor (compiles take about 3x longer).

    Returns:
        A :class:`Plan`.

    Raises:
        UserError: ``model`` is not a directory with a config.json, nor a config.json; or a bad option.
        hf_tpu.tpu_compile.UnknownTargetError: ``target`` is not a known target.
        MissingPackageError: torch-tpu (or, for int8/int4, torchao) is not installed; the message names the extra.
    """
    path = os.fspath(model)
    chosen, kwargs = _generate_kwargs(path, target, batch=batch, max_prompt_len=max_prompt_len,
                              max_new_tokens=max_new_tokens, dtype=dtype, quantization=quantization, buckets=buckets,
                              generation=generation)  # fmt: skip
    dump = os.fspath(dump_hlo) if dump_hlo is not None else None
    result = lower_and_compile(GENERATE_ENTRY, kwargs, chosen, progress=progress, dump_hlo=dump)
    return _plan_from(result, path, batch, max_prompt_len, max_new_tokens, quantization)


def plan_generate_each(
    model: str | os.PathLike,
    target: str,
    calls: dict[str, dict[str, Any]],
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Plan]:
    """:func:`plan_generate` of one model and target for several calls (``calls``: a name -> the call's keyword
    arguments as :func:`plan_generate` takes them: ``batch``, ``max_prompt_len``, ``max_new_tokens``, ``dtype``,
    ``quantization``, ``buckets``, ``generation``), lowered in one process and compiled in one
    (:func:`hf_tpu.tpu_compile.lower_and_compile_each`) instead of two processes per plan: several quantizations or
    call sizes of a model side by side.

    Args:
        model, target, progress: as for :func:`plan_generate`.
        calls: name -> keyword arguments of :func:`plan_generate` (its defaults for what a call leaves out).

    Returns:
        name -> the :class:`Plan` of that call.

    Raises:
        As :func:`plan_generate`, before anything is lowered, for any call.
    """
    path = os.fspath(model)
    signature = inspect.signature(plan_generate).parameters  # its defaults, not a copy of them
    defaults = {name: signature[name].default for name in ("batch", "max_prompt_len", "max_new_tokens",
                                                           "quantization")}  # fmt: skip
    calls = {name: {**defaults, **call} for name, call in calls.items()}
    checked = {name: _generate_kwargs(path, target, **call) for name, call in calls.items()}
    entries = {name: (GENERATE_ENTRY, kwargs) for name, (_, kwargs) in checked.items()}
    results = lower_and_compile_each(entries, find_target(target), progress=progress)
    return {
        name: _plan_from(results[name], path, call["batch"], call["max_prompt_len"], call["max_new_tokens"],
                         call["quantization"])  # fmt: skip
        for name, call in calls.items()
    }


def _generate_kwargs(
    path: str,
    target: str,
    *,
    batch: int = 1,
    max_prompt_len: int = 2048,
    max_new_tokens: int = 256,
    dtype: str | None = "bfloat16",
    quantization: str | None = None,
    buckets: str = "largest",
    generation: dict | None = None,
) -> tuple[Target, dict[str, Any]]:
    """The target and the lowering entry's keyword arguments of one :func:`plan_generate` call, its arguments
    checked first."""
    config_file = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise UserError(f"{path}: no config.json there; pass a model directory (save_pretrained) or its config.json")
    if buckets not in ("largest", "all"):
        raise UserError(f"buckets={buckets!r}: use 'largest' or 'all'")
    if quantization not in (None, "int8", "int4", "fp8"):
        raise UserError(f"quantization={quantization!r}: use int8 or int4 (weight-only, torchao) or fp8 (fine-grained)")
    chosen = find_target(target)
    require_packages(quantization)
    return chosen, {
        "model": path, "dtype": dtype, "batch": batch, "max_prompt_len": max_prompt_len,
        "max_new_tokens": max_new_tokens, "buckets": buckets, "quantization": quantization,
        "capacity": chosen.hbm_bytes, "generation": generation,
    }  # fmt: skip


PIPELINE_ENTRY = "hf_tpu.tpu_compile._pipeline:lower_pipeline"


def plan_pipeline(
    pipeline: str | os.PathLike,
    target: str = "v6e-1",
    *,
    height: int = 1024,
    width: int = 1024,
    batch: int = 1,
    guidance_scale: float | None = None,
    dtype: str = "bfloat16",
    progress: Callable[[str], None] | None = None,
    dump_hlo: str | os.PathLike | None = None,
) -> Plan:
    """Plan a diffusers pipeline's denoiser step on ``target``: the pipeline is built from its saved configs with
    deferred weights (nothing read), compiled as ``hf_tpu.diffusers.compile_pipeline`` compiles it and called once
    at ``height`` x ``width``; the denoiser's program is compiled for the target. The plan says whether every model
    component fits the chip's HBM, the step's compile time and its projected time (an estimate).

    Args:
        pipeline: a pipeline directory (``save_pretrained``'s layout, with model_index.json; weights not needed).
        target: a name of :data:`hf_tpu.tpu_compile.TARGETS`.
        height, width, batch: the call's size (``batch`` images per prompt batch).
        guidance_scale: the call's guidance (None: the pipeline's default; above 1, classifier-free guidance
            doubles the denoiser's batch in the pipelines that use it).
        dtype: the weights' dtype.
        progress, dump_hlo: as for :func:`plan_generate`.

    Returns:
        A :class:`Plan` with ``kind == "pipeline"`` (its :meth:`Plan.step_summary` is the denoiser step).

    Raises:
        UserError: ``pipeline`` is not a directory with a model_index.json.
        hf_tpu.tpu_compile.UnknownTargetError: ``target`` is not a known target.
        MissingPackageError: torch-tpu is not installed; the message names the extra.
    """
    path = os.fspath(pipeline)
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        raise UserError(f"{path}: no model_index.json there; pass a diffusers pipeline directory (save_pretrained)")
    chosen = find_target(target)
    require_packages()
    kwargs = {
        "pipeline": path, "height": height, "width": width, "batch": batch, "guidance_scale": guidance_scale,
        "dtype": dtype, "capacity": chosen.hbm_bytes,
    }  # fmt: skip
    dump = os.fspath(dump_hlo) if dump_hlo is not None else None
    result = lower_and_compile(PIPELINE_ENTRY, kwargs, chosen, progress=progress, dump_hlo=dump)
    plan = _plan_from(result, path, batch, None, None, None)
    plan.kind = "pipeline"
    # a pipeline's plan has no prompt, batch bucket or --quantization to change: the chip is what changes
    plan.suggestions = [s for s in plan.suggestions if s.startswith(("more chips", "a device with more HBM"))]
    return plan


def _plan_from(result: LoweringResult, path: str, batch, prompt, new, quantization) -> Plan:
    """The plan of ``result``: it fits only when every program compiled and weights, KV cache and the largest
    program's own bytes are within the device's HBM; a program libtpu refused for HBM makes it not fit (with the
    bytes it needed), any other failure makes it unplanned (``error``)."""
    info = dict(result.info)
    info.update(batch=batch, max_prompt_len=prompt, max_new_tokens=new, quantization=quantization)
    weights = int(info.get("weights_bytes", 0))
    kv = int(info.get("kv_cache_bytes") or info.get("kv_cache_estimate", 0))
    compiled = [p for p in result.programs if p.compiled]
    extra = max((p.temp_bytes + p.output_bytes - p.alias_bytes for p in compiled), default=0)
    peak = max((p.peak_bytes for p in compiled), default=0)
    ooms = {p.name: oom for p in result.programs if (oom := out_of_memory(p)) is not None}
    needed = max((oom["needed"] for oom in ooms.values()), default=0)
    total = int(max(weights + kv + extra, peak, needed))
    capacity = result.target.hbm_bytes
    hbm = {"capacity": capacity, "weights": weights, "kv_cache": kv, "temporaries": extra, "total": total}
    note = info.pop("skipped", None)
    if note:
        note = f"{note} ({(weights + kv) / GB:.1f} GB > {capacity / GB:.1f} GB)"
    error = result.error if result.error else None
    failed = [p for p in result.programs if not p.compiled and p.name not in ooms]
    if error is None and failed:
        error = "; ".join(f"{p.name} did not {'compile' if p.lowered else 'lower'}: "
                          f"{(p.error or '?').splitlines()[0][:300]}" for p in failed)  # fmt: skip
    if error is None and not note and not compiled and not ooms:
        error = "no program compiled"
    too_big = note is not None or bool(ooms) or total > capacity
    fits = not too_big and error is None and bool(compiled)
    plan = Plan(result.target, path, fits, hbm, result.programs, info, note, error)
    plan.out_of_memory = ooms
    plan.does_not_fit = too_big
    if too_big:
        plan.suggestions = _suggestions(plan, ooms)
    return plan


def _suggestions(plan: Plan, ooms: dict[str, dict[str, float]]) -> list[str]:
    """What would fit, estimated from the plan's bytes (each to re-plan to be sure): a smaller prompt bucket or batch
    (a prefill's own bytes grow with its tokens), int8 weights (about half the bytes of 16-bit linear weights; the
    input embedding stays), more chips."""
    cap, info = plan.hbm["capacity"], plan.info
    resident = plan.hbm["weights"] + plan.hbm["kv_cache"]
    out: list[str] = []
    for name, oom in ooms.items():
        needed, available = oom["needed"] or plan.hbm["total"], oom["available"] or cap
        if name.startswith("prefill-") and needed > resident and available > resident:
            share = (available - resident) / (needed - resident)  # of the prefill's own bytes that would fit
            bucket = int(name.split("-", 1)[1])
            if int(info.get("batch") or 1) > 1:
                out.append(f"a smaller batch: --batch {max(int(int(info['batch']) * share), 1)} or less ({name} "
                           f"needs {human(needed)} of {human(available)})")  # fmt: skip
            tokens = int(bucket * share)
            # a prompt is padded up to its bucket: the largest bucket within those tokens is what would fit
            rungs = [r for r in info.get("prompt_buckets") or [tokens] if r <= tokens]
            if rungs:
                out.append(f"a smaller prompt bucket: --max-prompt-len {max(rungs)} ({name}'s own bytes, "
                           f"{human(needed - resident)}, grow with its tokens: about {tokens} would fit in the "
                           f"{human(available - resident)} left beside the weights and KV cache)")  # fmt: skip
    weights = plan.hbm["weights"]
    if not info.get("quantization") and info.get("dtype") in ("bfloat16", "float16", "float32") and weights:
        linear = weights - int(info.get("gathered_embedding_bytes", 0))  # the input embedding is not quantized
        saved = linear * (0.75 if info["dtype"] == "float32" else 0.5)
        if plan.hbm["total"] - saved <= cap:
            out.append(f"--quantization int8: weight-only int8 weights take about {human(weights - saved)} instead "
                       f"of {human(weights)}, for a total near {human(plan.hbm['total'] - saved)}")  # fmt: skip
    chips = -(-plan.hbm["total"] // cap)
    family = plan.target.name.split("-")[0]
    from hf_tpu.tpu_compile.targets import TARGETS

    larger = sorted((t for t in TARGETS.values() if t.name.split("-")[0] == family and t.chips >= max(chips, 2)),
                    key=lambda t: t.chips)  # fmt: skip
    roomier = sorted((t for t in TARGETS.values() if t.hbm_bytes >= plan.hbm["total"] > cap),
                     key=lambda t: (t.hbm_bytes, t.chips))  # fmt: skip
    if roomier:
        out.append(f"a device with more HBM: --target {roomier[0].name} ({human(roomier[0].hbm_bytes)} per device)")
    if larger and larger[0].chips > plan.target.chips:
        out.append(f"more chips: about {human(plan.hbm['total'])} over {chips} or more devices with tensor parallelism "
                   f"(--target {larger[0].name}; hf-tpu plan does not compile tensor-parallel programs yet, so this is "
                   "arithmetic on the bytes)")  # fmt: skip
    return out
