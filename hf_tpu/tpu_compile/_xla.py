"""libtpu's compiler for a TPU this host does not have, and XLA:CPU for the numerics check.

``python -m hf_tpu.tpu_compile._xla IN.json TOPOLOGY OUT.json [DUMP_DIR]`` compiles each lowered program of IN.json
(the lowering process's output) for the first chip of ``TOPOLOGY`` (a libtpu topology name, ``v6e:1x1``) with
``jax.experimental.topologies``: libtpu's compile-only client, no chip needed. Per program it writes whether it
compiled (else the compiler's message), the seconds it took, XLA's memory analysis (argument, output, alias, temp
and generated-code bytes) and cost analysis (FLOPs, bytes accessed, ``optimal_seconds``; XLA reports a negative
``optimal_seconds`` where it cannot estimate, as for programs with Mosaic custom calls). With ``DUMP_DIR``, libtpu
dumps each program (``--xla_jf_dump_to``, which slows its compile about 3x); its scheduled HLO is kept as
``DUMP_DIR/program-<i>.hlo.txt`` (the rest of the dump is removed) and split into the part of ``bytes accessed``
that is HBM traffic (:mod:`hf_tpu.tpu_compile.hlo_bytes`): the record's ``hbm_bytes`` and ``hlo_path``.

It runs in a process without torch_tpu's device (JAX loads libtpu itself). :func:`run_on_cpu` runs a program with
no custom call on XLA:CPU, for comparing its result with torch's on the CPU.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

_MEMORY = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "code_bytes": "generated_code_size_in_bytes",
}


_SCAN = re.compile(
    r"(?P<indent>[ ]*)%(?P<name>[\w.]+):2 = chlo\.scan\(%(?P<x>[\w.#]+)\) inits \(%(?P<init>[\w.#]+)\) "
    r"dimension=(?P<dim>\d+) +attributes \{is_associative = true, is_reverse = false, scan_dim_size = (?P<n>\d+) : i64\} \{\n"
    r"\s*\^bb0\(%(?P<a>\w+): tensor<(?P<c>[\w]+)>, %(?P<b>\w+): tensor<(?P=c)>\):\n"
    r"\s*%(?P<s>[\w.]+) = stablehlo\.add %(?P=a), %(?P=b) : tensor<(?P=c)>\n"
    r"\s*stablehlo\.return %(?P=s), %(?P=s) : tensor<(?P=c)>, tensor<(?P=c)>\n"
    r"\s*\} : \(tensor<(?P<shape>[\w]+)>, tensor<(?P=c)>\) -> \(tensor<(?P=shape)>, tensor<(?P=c)>\)\n"
)


def _new_name(name: str) -> str:
    """An SSA name for the rewrite's values (MLIR names that start with a digit must be all digits)."""
    return "hf_scan_" + name.replace(".", "_")


def _cumsum_as_reduce_window(text: str) -> str:
    """An inclusive cumulative sum from zero along one dimension (``torch.cumsum``: MoE routing's tokens-per-expert
    offsets, BLOOM's ALiBi positions from the attention mask, top-p's cumulative probabilities in the serving step's
    sampling), which torch_tpu lowers to ``chlo.scan``, rewritten as the equivalent ``stablehlo.reduce_window`` (a
    window of the whole length along that dimension, padded before by length - 1) and, for the scan's final carry,
    the last slice. Any other scan is left as it is."""

    def rewrite(m: re.Match) -> str:
        *dims, elem = m["shape"].split("x")
        dims = [int(d) for d in dims]
        dim, n = int(m["dim"]), int(m["n"])
        zero = re.search(rf"%{re.escape(m['init'])} = stablehlo\.constant dense<0(\.0+e\+00)?> : tensor<{m['c']}>",
                         text)  # (an integer zero, or a float one: ``dense<0.000000e+00>``)
        if zero is None or not dims or dim >= len(dims) or dims[dim] != n or not elem.isalnum():
            return m.group(0)
        i, name = m["indent"], _new_name(m["name"])
        vec, sca = f"tensor<{m['shape']}>", f"tensor<{elem}>"
        window = ", ".join(str(n if k == dim else 1) for k in range(len(dims)))
        pads = ", ".join(f"[{n - 1 if k == dim else 0}, 0]" for k in range(len(dims)))
        last = ", ".join(f"{n - 1}:{n}" if k == dim else f"0:{d}" for k, d in enumerate(dims))
        last_shape = "x".join(str(1 if k == dim else d) for k, d in enumerate(dims)) + f"x{elem}"
        return (
            f"{i}%{name}_zero = stablehlo.constant dense<{'0.000000e+00' if zero[1] else 0}> : {sca}\n"
            f"{i}%{name}_cumsum = \"stablehlo.reduce_window\"(%{m['x']}, %{name}_zero) <{{padding = dense<[{pads}]> "
            f": tensor<{len(dims)}x2xi64>, window_dimensions = array<i64: {window}>}}> ({{\n"
            f"{i}^bb0(%{name}_l: {sca}, %{name}_r: {sca}):\n"
            f"{i}  %{name}_sum = stablehlo.add %{name}_l, %{name}_r : {sca}\n"
            f"{i}  stablehlo.return %{name}_sum : {sca}\n"
            f"{i}}}) : ({vec}, {sca}) -> {vec}\n"
            f"{i}%{name}_last1 = stablehlo.slice %{name}_cumsum [{last}] : ({vec}) -> tensor<{last_shape}>\n"
            f"{i}%{name}_last = stablehlo.reshape %{name}_last1 : (tensor<{last_shape}>) -> tensor<{m['c']}>\n"
        )

    names = [m["name"] for m in _SCAN.finditer(text)]
    text = _SCAN.sub(rewrite, text)
    for name in names:
        if f"%{_new_name(name)}_cumsum" in text:
            text = re.sub(rf"%{re.escape(name)}#0\b", f"%{_new_name(name)}_cumsum", text)
            text = re.sub(rf"%{re.escape(name)}#1\b", f"%{_new_name(name)}_last", text)
    return text


def normalize(text: str) -> str:
    """torch_tpu 0.2.0 builds its modules with a newer MLIR than jax 0.10.2 hands to libtpu 0.0.52's compile-only
    client (its StableHLO 1.13.7), and two constructs do not cross:

    - ``chlo.top_k``'s ``is_stable`` attribute, unknown to jax's CHLO: ``is_stable = false`` is what the older op
      does, so it is dropped (``true`` is left for the parser to refuse: no silent change of meaning);
    - ``chlo.scan`` (a cumulative sum), which jax can only pass on as a StableHLO composite newer than the plugin's:
      a cumulative sum from zero becomes the equivalent ``reduce_window`` (:func:`_cumsum_as_reduce_window`);
      other scans are left, and refused by the compiler with its message.

    On a chip, torch_tpu hands its module to its own runtime, and neither rewrite happens."""
    return _cumsum_as_reduce_window(text.replace(", is_stable = false)", ")"))


def _compile_one(client, devices, text: str) -> dict:
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    started = time.perf_counter()
    with jax_mlir.make_ir_context():
        module = ir.Module.parse(normalize(text))
        executable = client.compile(module, xla_client.DeviceList(tuple(devices)), xla_client.CompileOptions())
    record = {"compiled": True, "compile_seconds": time.perf_counter() - started}
    stats = executable.get_compiled_memory_stats()
    for key, attr in _MEMORY.items():
        record[key] = int(getattr(stats, attr))
    cost = executable.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    record["flops"] = float(cost.get("flops", 0.0))
    record["bytes_accessed"] = float(cost.get("bytes accessed", 0.0))
    record["transcendentals"] = float(cost.get("transcendentals", 0.0))
    record["optimal_seconds"] = float(cost.get("optimal_seconds", -1.0))
    return record


_DUMP_ONLY_HLO = "--xla_jf_dump_llo_text=false --xla_jf_dump_llo_html=false --xla_jf_dump_fusion_computations=false"


def _keep_hlo(raw: str, dump_dir: str, i: int, record: dict) -> None:
    """Keep the scheduled HLO libtpu dumped for program ``i`` under ``raw`` and its HBM split; drop the rest."""
    import glob
    import shutil

    from hf_tpu.tpu_compile.hlo_bytes import find_dumps, split

    found = find_dumps(raw) if os.path.isdir(raw) else []
    if found:
        path = os.path.join(dump_dir, f"program-{i}.hlo.txt")
        shutil.move(found[0], path)
        record["hlo_path"] = path
        with open(path) as f:
            record["hbm_bytes"] = split(f.read()).hbm_bytes
    for entry in glob.glob(os.path.join(raw, "*")):
        shutil.rmtree(entry) if os.path.isdir(entry) else os.remove(entry)


def compile_programs(texts: list[str], topology: str, dump_dir: str | None = None) -> list[dict]:
    """Compile each StableHLO text for the first chip of ``topology``; one record per text (see the module doc).
    With ``dump_dir``, each record also has ``hlo_path`` and ``hbm_bytes`` (libtpu must not be loaded yet: its
    dump flag is read when it starts)."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    raw = None
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        raw = os.path.join(dump_dir, "libtpu")
        # the scheduled HLO is all that is kept: the per-kernel LLO text and HTML (most of a dump) are not written
        flags = f"--xla_jf_dump_to={raw} {_DUMP_ONLY_HLO}"
        os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {flags}".strip()
    from jax.experimental import topologies

    device = topologies.get_topology_desc(topology, "tpu").devices[0]
    records = []
    for i, text in enumerate(texts):
        try:
            records.append(_compile_one(device.client, [device], text))
            if raw is not None:
                _keep_hlo(raw, dump_dir, i, records[-1])
            print(f"hf_tpu.tpu_compile: compiled program {i + 1} of {len(texts)} for {topology} "
                  f"({records[-1]['compile_seconds']:.1f}s)", flush=True)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the compiler's refusal is the record
            message = "\n".join(line for line in str(exc).splitlines() if line.strip())
            records.append({"compiled": False, "error": f"{type(exc).__name__}: {message[:2000]}"})
    return records


def run_on_cpu(text: str, arrays: list) -> list:
    """Run a StableHLO program (no custom call) on XLA:CPU with ``arrays`` (numpy, in the module's argument order);
    returns its results as numpy arrays."""
    import jax
    import jax.extend.backend
    import numpy as np
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    backend = jax.extend.backend.get_backend("cpu")
    device = backend.devices()[0]
    with jax_mlir.make_ir_context():
        module = ir.Module.parse(normalize(text))
        executable = backend.compile_and_load(module, xla_client.DeviceList((device,)), xla_client.CompileOptions())
    buffers = [jax.device_put(np.asarray(a), device) for a in arrays]
    outs = executable.execute(buffers)
    return [np.asarray(o) for o in outs]


def main(argv: list[str]) -> int:
    in_path, topology, out_path, *dump = argv
    with open(in_path) as f:
        texts = json.load(f)
    records = compile_programs(texts, topology, dump[0] if dump else None)
    with open(out_path, "w") as f:
        json.dump(records, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
