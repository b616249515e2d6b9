"""Run the programs ``hf-tpu plan`` compiles on a real TPU, and set the compiler's figures beside the measured ones.

``hf-tpu plan`` lowers hf_tpu's graphs through torch_tpu's front end on any host and reports what libtpu's compiler
estimates. This script checks those estimates on a chip, in two steps on two machines:

    # 1. anywhere with torch-tpu installed (no chip): lower generate's programs, keep their StableHLO
    python scripts/chip_programs.py lower MODEL_DIR programs.json --target v5e-1 \
        --max-prompt-len 512 --max-new-tokens 128 --dtype bfloat16

    # 2. on a TPU VM with jax (torch and torch-tpu not needed): compile each program for the local chip with
    #    JAX's TPU client, run it on zero-filled inputs of its argument shapes, time it; next to it, a plain
    #    matrix-vector product over as many bytes as the model's weights (the chip's own streaming floor)
    python scripts/chip_programs.py run programs.json --out measured.json

Zero inputs are enough for timing: the programs have no data-dependent control flow (hf_tpu's loop runs one
static-shape graph per step). They are not a numerics check (the compile tier's XLA:CPU comparisons are).
The ``run`` step imports only ``hf_tpu/tpu_compile/_xla.py`` (by path), so the hf_tpu checkout needs no install
there. Figures from one run are in docs/planning.md ("Measured on a chip").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lower(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    from hf_tpu.tpu_compile import lower_and_compile

    kwargs = {"model": args.model, "max_prompt_len": args.max_prompt_len, "max_new_tokens": args.max_new_tokens,
              "dtype": args.dtype, "batch": args.batch}  # fmt: skip
    result = lower_and_compile("hf_tpu.tpu_compile._generate:lower_generate", kwargs, args.target,
                               progress=lambda m: print(m, file=sys.stderr, flush=True))  # fmt: skip
    if result.error:
        print(f"lowering failed: {result.error} (at {result.where})", file=sys.stderr)
        return 1
    programs = [{
        "name": p.name, "text": p.text, "arguments": p.arguments, "compiled_for": args.target,
        "bytes_accessed": p.bytes_accessed, "flops": p.flops, "optimal_seconds": p.optimal_seconds,
    } for p in result.programs]  # fmt: skip
    facts = {k: result.info.get(k) for k in ("model_type", "parameters", "dtype", "weights_bytes", "kv_cache_bytes")}
    Path(args.out).write_text(json.dumps({"model": args.model, "facts": facts, "programs": programs}))
    print(f"{len(programs)} program(s) written to {args.out}", file=sys.stderr)
    return 0


def _xla_module():
    spec = importlib.util.spec_from_file_location("_hf_tpu_xla", ROOT / "hf_tpu" / "tpu_compile" / "_xla.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timed(call, repeats: int) -> dict:
    call()  # the first run loads the program
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return {"step_seconds_median": statistics.median(times), "step_seconds_min": min(times)}


def run(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_enable_x64", True)  # the programs take int64 ids and positions, as torch does
    import jax.extend.backend
    import jax.numpy as jnp
    import numpy as np
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    xla = _xla_module()
    backend = jax.extend.backend.get_backend(args.platform)
    device = backend.devices()[0]
    data = json.loads(Path(args.programs).read_text())
    out = {"device": str(getattr(device, "device_kind", device)), "jax": jax.__version__, "facts": data["facts"],
           "programs": []}  # fmt: skip
    for program in data["programs"]:
        record = {"name": program["name"], "estimate_bytes_accessed": program["bytes_accessed"]}
        try:
            started = time.perf_counter()
            with jax_mlir.make_ir_context():
                module = ir.Module.parse(xla.normalize(program["text"]))
                executable = backend.compile_and_load(module, xla_client.DeviceList((device,)),
                                                      xla_client.CompileOptions())  # fmt: skip
            record["compile_seconds"] = time.perf_counter() - started
            cost = executable.cost_analysis() or {}
            cost = cost[0] if isinstance(cost, list) else cost
            record["bytes_accessed_here"] = float(cost.get("bytes accessed", 0.0))
            arrays = [jax.device_put(np.zeros(shape, dtype=jnp.dtype(dtype)), device)
                      for shape, dtype in program["arguments"]]  # fmt: skip

            def step(executable=executable, arrays=arrays):
                for o in executable.execute(arrays):
                    o.block_until_ready()

            record.update(_timed(step, args.repeats))
        except Exception as exc:  # noqa: BLE001 - a program that fails on the chip is a record, not the end
            record["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        out["programs"].append(record)
        print(json.dumps(record), flush=True)
    weights = int(data["facts"].get("weights_bytes") or 0)
    if weights:  # the chip's streaming floor: one bf16 matrix-vector product over as many bytes as the weights
        cols = weights // 2 // 4096 if args.platform == "tpu" else 256
        matrix = jnp.zeros((4096, cols), dtype=jnp.bfloat16, device=device)
        vector = jnp.zeros((1, 4096), dtype=jnp.bfloat16, device=device)
        matvec = jax.jit(lambda v, m: v @ m)
        reference = _timed(lambda: matvec(vector, matrix).block_until_ready(), args.repeats)
        out["weights_matvec"] = {"bytes": 4096 * cols * 2, **reference}
        print(json.dumps({"weights_matvec": out["weights_matvec"]}), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    low = sub.add_parser("lower", help="lower generate's programs (needs torch-tpu; no chip)")
    low.add_argument("model", help="a model directory or its config.json")
    low.add_argument("out", help="the programs file to write")
    low.add_argument("--target", default="v5e-1")
    low.add_argument("--batch", type=int, default=1)
    low.add_argument("--max-prompt-len", type=int, default=512)
    low.add_argument("--max-new-tokens", type=int, default=128)
    low.add_argument("--dtype", default="bfloat16")
    go = sub.add_parser("run", help="compile and time the programs on this machine's TPU (needs jax)")
    go.add_argument("programs", help="the file `lower` wrote")
    go.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "measured.json"))
    go.add_argument("--repeats", type=int, default=20)
    go.add_argument("--platform", default="tpu", help="JAX platform to run on (cpu: a check of this script only)")
    args = parser.parse_args(argv)
    return lower(args) if args.command == "lower" else run(args)


if __name__ == "__main__":
    sys.exit(main())
