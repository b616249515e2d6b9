"""Run the ragged-dot MoE kernel on a real TPU: its Pallas program against XLA's own ``lax.ragged_dot``.

The kernel ships in hf_tpu/kernels/hub/ragged-dot-tpu (the Hub layout ``kernels.get_kernel`` loads); its JAX side,
``_jax_kernels.py``, is imported here by path, so a TPU VM with jax (no torch, no torch-tpu, no hf_tpu install)
runs it::

    python scripts/chip_kernels.py --out kernels.json              # on a TPU VM
    python scripts/chip_kernels.py --platform cpu --quick          # anywhere: a check of this script (interpret mode)

Two parts:

- *numerics*: small and unaligned shapes, empty groups, rows past the last group, both weight layouts, float32
  and bfloat16: the Pallas kernel against a float64 NumPy loop (the same reference as tests/kernels).
- *speed*: the experts layers of three MoE models (Qwen3-30B-A3B, Mixtral-8x7B, gpt-oss-20b; bfloat16, their
  own routing widths), with balanced and skewed routing: one grouped matmul (the gate-up projection) and the whole
  experts layer (``moe_experts``: route, two grouped matmuls, combine), Pallas vs ``lax.ragged_dot``, compile time
  and median step time of each, side by side in one run. The result of each pair is compared too (the two differ
  only by accumulation order). Target: the Pallas kernel no slower than XLA's ``ragged_dot`` (the "auto"
  implementation picks Pallas on a TPU); a pair that misses it says "missed".

Figures from one run are in docs/kernels.md ("Measured on a chip").
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
KERNEL = ROOT / "hf_tpu/kernels/hub/ragged-dot-tpu/build/torch-tpu/ragged_dot_tpu/_jax_kernels.py"

# (name, hidden, intermediate, experts, top-k): the experts layers timed on the chip
MODELS = [
    ("Qwen3-30B-A3B", 2048, 768, 128, 8),
    ("Mixtral-8x7B", 4096, 14336, 8, 2),
    ("gpt-oss-20b", 2880, 2880, 32, 4),
]


def _kernels():
    spec = importlib.util.spec_from_file_location("_ragged_dot_jax_kernels", KERNEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(lhs, rhs, sizes, rhs_transposed):
    import numpy as np

    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    out = np.zeros((lhs.shape[0], n))
    start = 0
    for g, size in enumerate(sizes):
        w = rhs[g].T if rhs_transposed else rhs[g]
        out[start : start + size] = lhs[start : start + size] @ w
        start += size
    return out


def numerics(k, implementation: str, quick: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    cases = [  # (m, k, n, group sizes, dtype)
        (37, 200, 130, [5, 0, 20, 0, 9], "float32"),  # unaligned everything, empty groups, 3 rows past the last group
        (128, 256, 256, [128, 0, 0, 0], "float32"),
        (300, 1000, 700, [100, 0, 150, 50], "float32"),  # K and N past one tile
        (256, 512, 384, [40, 0, 100, 16, 60, 0, 30, 10], "bfloat16"),
        (8, 64, 64, [0, 0, 0, 0], "bfloat16"),  # nothing routed: all zeros
    ]
    if not quick:
        cases.append((1000, 2880, 2880, [200, 0, 300, 1, 499, 0, 0, 0], "bfloat16"))  # gpt-oss' unaligned width
    rows = []
    rng = np.random.default_rng(0)
    for m, kk, n, sizes, dtype in cases:
        for transposed in (False, True):
            lhs = rng.standard_normal((m, kk), np.float32)
            shape = (len(sizes), n, kk) if transposed else (len(sizes), kk, n)
            rhs = rng.standard_normal(shape, np.float32) / np.sqrt(kk)
            lhs_j, rhs_j = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
            got = k._dot_for(implementation)(lhs_j, rhs_j, jnp.asarray(sizes, jnp.int32), rhs_transposed=transposed)
            got = np.asarray(jax.device_get(got), np.float64)
            # the reference sees the inputs as rounded to the kernel's dtype
            want = _reference(np.asarray(lhs_j.astype(jnp.float32)), np.asarray(rhs_j.astype(jnp.float32)), sizes,
                              transposed)  # fmt: skip
            scale = max(float(np.abs(want).max()), 1e-6)
            err = float(np.abs(got - want).max()) / scale
            tolerance = 2e-2 if dtype == "bfloat16" else 1e-3
            tail = got[sum(sizes) :]
            rows.append({
                "shape": f"M={m} K={kk} N={n} G={len(sizes)}", "dtype": dtype, "rhs_transposed": transposed,
                "relative_error": err, "tolerance": tolerance, "rows_past_groups_zero": bool((tail == 0).all()),
                "ok": err <= tolerance and bool((tail == 0).all()),
            })  # fmt: skip
    return rows


def _timed(fn, repeats: int) -> dict:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return {"first_call_seconds": compile_s, "median_seconds": statistics.median(times), "min_seconds": min(times)}


def _routing(rng, tokens: int, experts: int, top_k: int, skewed: bool):
    import numpy as np

    if skewed:  # most tokens to a few experts: a quarter of the experts get ~90% of the slots
        p = np.full(experts, 0.1 / (experts - max(experts // 4, 1)))
        p[: max(experts // 4, 1)] = 0.9 / max(experts // 4, 1)
    else:
        p = np.full(experts, 1.0 / experts)
    index = np.stack([rng.choice(experts, size=top_k, replace=False, p=p) for _ in range(tokens)])
    weights = rng.random((tokens, top_k)).astype(np.float32)
    return index.astype(np.int32), weights / weights.sum(1, keepdims=True)


def speed(k, implementation: str, tokens: int, repeats: int, models) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = []
    rng = np.random.default_rng(1)
    for name, hidden, inter, experts, top_k in models:
        key = jax.random.PRNGKey(0)
        k1, k2, k3 = jax.random.split(key, 3)
        # transformers' layout: gate_up (E, 2I, H), down (E, H, I), i.e. rhs_transposed
        gate_up = (jax.random.normal(k1, (experts, 2 * inter, hidden), jnp.float32) / np.sqrt(hidden)).astype(
            jnp.bfloat16)  # fmt: skip
        down = (jax.random.normal(k2, (experts, hidden, inter), jnp.float32) / np.sqrt(inter)).astype(jnp.bfloat16)
        hidden_states = jax.random.normal(k3, (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
        for skewed in (False, True):
            index, weights = _routing(rng, tokens, experts, top_k, skewed)
            ids = index.reshape(-1)
            order = np.argsort(ids, kind="stable")
            sizes = jnp.asarray(np.bincount(ids, minlength=experts), jnp.int32)
            lhs = hidden_states[jnp.asarray(order // top_k)]
            m = lhs.shape[0]
            row = {"model": name, "routing": "skewed" if skewed else "balanced", "tokens": tokens, "rows": m,
                   "hidden": hidden, "intermediate": inter, "experts": experts, "top_k": top_k}  # fmt: skip
            dots = {}
            for impl in (implementation, "xla"):
                fn = k._dot_for(impl)
                dots[impl] = _timed(lambda fn=fn: fn(lhs, gate_up, sizes, rhs_transposed=True), repeats)
            a = np.asarray(k._dot_for(implementation)(lhs, gate_up, sizes, rhs_transposed=True), np.float32)
            b = np.asarray(k._dot_for("xla")(lhs, gate_up, sizes, rhs_transposed=True), np.float32)
            flops = 2 * m * hidden * 2 * inter
            row["gate_up"] = {
                "pallas": dots[implementation], "xla": dots["xla"],
                "pallas_over_xla": dots[implementation]["median_seconds"] / dots["xla"]["median_seconds"],
                "pallas_tflops": flops / dots[implementation]["median_seconds"] / 1e12,
                "xla_tflops": flops / dots["xla"]["median_seconds"] / 1e12,
                "max_difference_over_scale": float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6)),
            }  # fmt: skip
            args = (hidden_states, jnp.asarray(index), jnp.asarray(weights, jnp.bfloat16), gate_up, down)
            layers = {}
            for impl in (implementation, "xla"):
                layers[impl] = _timed(
                    lambda impl=impl: k.moe_experts(*args, rhs_transposed=True, implementation=impl), repeats
                )
            a = np.asarray(k.moe_experts(*args, rhs_transposed=True, implementation=implementation), np.float32)
            b = np.asarray(k.moe_experts(*args, rhs_transposed=True, implementation="xla"), np.float32)
            row["experts_layer"] = {
                "pallas": layers[implementation], "xla": layers["xla"],
                "pallas_over_xla": layers[implementation]["median_seconds"] / layers["xla"]["median_seconds"],
                "max_difference_over_scale": float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6)),
            }  # fmt: skip
            rows.append(row)
            print(_speed_line(row), flush=True)
    return rows


def tiles(k, tokens: int, repeats: int, models, interpret: bool = False) -> list[dict]:
    """Each model's two grouped matmuls (gate-up, down; balanced routing) over the tilings that pass the kernel's
    checks: the kernel's own choice against the fastest, and XLA's ``ragged_dot`` beside them."""
    import itertools

    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = []
    rng = np.random.default_rng(2)
    for name, hidden, inter, experts, top_k in models:
        index, _ = _routing(rng, tokens, experts, top_k, False)
        sizes = jnp.asarray(np.bincount(index.reshape(-1), minlength=experts), jnp.int32)
        m = tokens * top_k
        for part, (kk, n) in (("gate_up", (hidden, 2 * inter)), ("down", (inter, hidden))):
            key = jax.random.PRNGKey(len(rows))
            rhs = jax.random.normal(key, (experts, n, kk), jnp.float32).astype(jnp.bfloat16)
            lhs = jax.random.normal(key, (m, kk), jnp.float32).astype(jnp.bfloat16)
            auto = k._tile_sizes(m, n, kk, lhs.dtype)
            found = []
            tns = sorted({c for c in (128, 256, 384, 512, 640, 768, 1024, 1152, 1536, 2048, n) if c <= n})
            tks = sorted({c for c in (512, 1024, 2048, kk) if c <= kk})
            for tm, tn, tk in itertools.product((128, 256, 512), tns, tks):
                try:
                    k._check_tiles(m, n, kk, tm, tn, tk, lhs.dtype, False)
                except ValueError:
                    continue
                fn = lambda tm=tm, tn=tn, tk=tk: k.ragged_dot_pallas(lhs, rhs, sizes, rhs_transposed=True, tm=tm,
                                                                     tn=tn, tk=tk, interpret=interpret)  # fmt: skip
                try:
                    t = _timed(fn, repeats)["median_seconds"]
                except Exception as e:  # noqa: BLE001 - a tiling Mosaic refuses is a row saying so
                    print(f"  {name} {part} tm={tm} tn={tn} tk={tk}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                found.append({"tm": tm, "tn": tn, "tk": tk, "median_seconds": t})
            xla = _timed(lambda: k.ragged_dot_xla(lhs, rhs, sizes, rhs_transposed=True), repeats)["median_seconds"]
            found.sort(key=lambda r: r["median_seconds"])
            mine = next((r for r in found if (r["tm"], r["tn"], r["tk"]) == auto), None)
            row = {"model": name, "part": part, "M": m, "K": kk, "N": n, "G": experts, "auto": auto,
                   "auto_seconds": mine and mine["median_seconds"], "xla_seconds": xla, "best": found[:5],
                   "tried": len(found)}  # fmt: skip
            rows.append(row)
            if not found:
                print(f"tiles {name} {part}: no tiling ran", flush=True)
                continue
            best = found[0]
            print(f"tiles {name:<14} {part:<8} M={m} K={kk} N={n}: auto {auto} "
                  f"{(mine or {}).get('median_seconds', float('nan')) * 1e3:.3f} ms; best ({best['tm']}, {best['tn']}, "
                  f"{best['tk']}) {best['median_seconds'] * 1e3:.3f} ms; xla {xla * 1e3:.3f} ms; "
                  f"{len(found)} tilings", flush=True)  # fmt: skip
    return rows


def _speed_line(row: dict) -> str:
    parts = [f"{row['model']:<14} {row['routing']:<8} M={row['rows']:<6}"]
    for part in ("gate_up", "experts_layer"):
        r = row[part]
        verdict = "" if r["pallas_over_xla"] <= 1.0 else " missed"
        parts.append(
            f"{part}: pallas {r['pallas']['median_seconds'] * 1e3:.3f} ms, xla {r['xla']['median_seconds'] * 1e3:.3f} ms "
            f"({r['pallas_over_xla']:.2f}x{verdict}; diff {r['max_difference_over_scale']:.1e})"
        )
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernels.json"))
    parser.add_argument("--platform", default="tpu", help="JAX platform (cpu: a check of this script, interpret mode)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per experts layer in the speed part")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="small shapes only (with --platform cpu)")
    parser.add_argument("--tiles", action="store_true", help="also time every tiling of the models' matmuls")
    args = parser.parse_args(argv)
    os.environ["JAX_PLATFORMS"] = args.platform
    import jax

    k = _kernels()
    implementation = "pallas" if args.platform == "tpu" else "pallas_interpret"
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.device_kind} ({implementation})", flush=True)
    result = {"jax": jax.__version__, "device": device.device_kind, "implementation": implementation}
    result["numerics"] = numerics(k, implementation, args.quick)
    for r in result["numerics"]:
        print(f"numerics {r['shape']:<26} {r['dtype']:<9} transposed={r['rhs_transposed']!s:<5} "
              f"error {r['relative_error']:.1e} (<= {r['tolerance']:.0e}) {'ok' if r['ok'] else 'FAILED'}")  # fmt: skip
    models = [("tiny", 64, 32, 4, 2)] if args.quick else MODELS
    tokens = 16 if args.quick else args.tokens
    result["speed"] = speed(k, implementation, tokens, 2 if args.quick else args.repeats, models)
    if args.tiles:
        result["tiles"] = tiles(k, tokens, 2 if args.quick else 10, models, interpret=implementation != "pallas")
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"written to {args.out}")
    return 0 if all(r["ok"] for r in result["numerics"]) else 1


if __name__ == "__main__":
    sys.exit(main())
