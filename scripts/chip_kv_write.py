"""Where a decode step's KV-cache write costs its time on a TPU: chip_bench's lean JAX step beside forms of it that
read the cache without writing it and write the new rows in a second, donated program.

hf_tpu's decode programs reach a chip through torch_tpu 0.2.0's ``torch.compile`` backend, which donates no buffers:
the cache a step updates is copied (docs/planning.md, "Measured on a chip"). This script asks what a decode step
would cost if its graph did not write the cache at all and the new K/V rows were written afterwards in place (as
torch_tpu's eager in-place ops do: ``torch_tpu._internal.execution_mode.disable_inplace_buffer_donation`` is False by
default). Each form runs 30 steps back to back (the position advancing, the caches fed from step to step) for the
Llama-3.2-1B shape; each form's last greedy tokens are recorded (equal across forms on a CPU with ``--quick``; on a
chip the random bf16 weights leave near-tied logits, whose argmax can flip with a program's order of summation).

  lean        chip_bench's lean step: ``dynamic_update_slice`` in the step, caches donated (the reference)
  undonated   the same step, caches not donated (what a compile that donates nothing runs)
  where_one   the step attends over ``where(slot == position, new row, cache)`` and returns the new rows; one donated
              program writes every layer's rows
  merge_one   the step attends over the cache (slots before the position) and the new row (their scores
              concatenated) and returns the rows; one donated writer
  where_each  as ``where_one``, with one donated writer per cache tensor (an eager in-place write per layer's K and V)

Usage (on a TPU VM with jax; ``--quick``: tiny shapes, on any host)::

    python scripts/chip_kv_write.py --out $OUT [--batches 8 64] [--forms lean undonated ...]

Records (one JSON line per form and batch) go to ``$OUT/kv_write.jsonl`` as they are taken. Figures from a run are
in docs/chip_v5e_kv_write.jsonl and docs/planning.md ("Measured on a chip").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chip_bench as cb  # noqa: E402

FORMS = ["lean", "undonated", "where_one", "merge_one", "where_each"]
QUICK = dict(cb.LLAMA_1B, layers=2, vocab=512, hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=32)


def read_only_step(cfg: dict, mode: str):
    """``step(params, ids, caches, position) -> (next ids, [(k row, v row) per layer])``; the caches only read."""
    import jax
    import jax.numpy as jnp

    nh, kvh, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]

    def step(params, ids, caches, position):
        x = params["embed"][ids]
        b = x.shape[0]
        rows = []
        for layer, (kc, vc) in zip(params["layers"], caches):
            slots = jnp.arange(kc.shape[2])
            h = cb._rms(x, layer["ln1"])
            q = (h @ layer["wq"]).reshape(b, nh, hd)
            k = (h @ layer["wk"]).reshape(b, kvh, hd)
            v = (h @ layer["wv"]).reshape(b, kvh, hd)
            q, k = cb._rope(q, position), cb._rope(k, position)
            qg = q.reshape(b, kvh, nh // kvh, hd)
            if mode == "where":
                here = (slots == position)[None, None, :, None]
                keys, values = jnp.where(here, k[:, :, None, :], kc), jnp.where(here, v[:, :, None, :], vc)
                s = jnp.einsum("bkgd,bksd->bkgs", qg, keys, preferred_element_type=jnp.float32) / jnp.sqrt(hd)
                p = jax.nn.softmax(jnp.where(slots <= position, s, -1e30), axis=-1).astype(x.dtype)
                o = jnp.einsum("bkgs,bksd->bkgd", p, values)
            else:  # merge: the cache's slots before the position, then the new row's score
                s = jnp.einsum("bkgd,bksd->bkgs", qg, kc, preferred_element_type=jnp.float32) / jnp.sqrt(hd)
                s = jnp.where(slots < position, s, -1e30)
                s_new = jnp.einsum("bkgd,bkd->bkg", qg, k, preferred_element_type=jnp.float32)[..., None] / jnp.sqrt(hd)
                p = jax.nn.softmax(jnp.concatenate([s, s_new], -1), axis=-1).astype(x.dtype)
                o = jnp.einsum("bkgs,bksd->bkgd", p[..., :-1], vc) + p[..., -1:] * v[:, :, None, :]
            rows.append((k, v))
            x = x + o.reshape(b, nh * hd) @ layer["wo"]
            h = cb._rms(x, layer["ln2"])
            g, u = jnp.split(h @ layer["gate_up"], 2, -1)
            x = x + (jax.nn.silu(g) * u) @ layer["down"]
        x = cb._rms(x, params["norm"])
        logits = jnp.einsum("bh,vh->bv", x, params.get("head", params["embed"]), preferred_element_type=jnp.float32)
        return jnp.argmax(logits, -1).astype(jnp.int32), rows

    return jax.jit(step)


def _write_all(caches, rows, position):
    return [(_write_one(kc, k, position), _write_one(vc, v, position)) for (kc, vc), (k, v) in zip(caches, rows)]


def _write_one(cache, row, position):
    import jax

    return jax.lax.dynamic_update_slice(cache, row[:, :, None, :], (0, 0, position, 0))


def _timed(run_step, ids, caches, steps: int):
    """Seconds per step with ``steps`` steps dispatched back to back (two warm steps first), and the last ids."""
    import jax

    for pos in (0, 1):
        ids, caches = run_step(ids, caches, pos)
        jax.block_until_ready((ids, caches))
    t0 = time.perf_counter()
    for pos in range(2, steps + 2):
        ids, caches = run_step(ids, caches, pos)
    jax.block_until_ready((ids, caches))
    return (time.perf_counter() - t0) / steps, ids


def measure(out: Path, batches: list[int], forms: list[str], quick: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp

    cfg = QUICK if quick else cb.LLAMA_1B
    steps = 3 if quick else 30
    cache_len = cb.PROMPT + cb.NEW_TOKENS
    params = cb.lean_params(cfg, jax.random.PRNGKey(1))
    lean = cb.lean_step(cfg)
    undonated = jax.jit(lean.__wrapped__)
    read_only = {mode: read_only_step(cfg, mode) for mode in ("where", "merge")}
    write_all = jax.jit(_write_all, donate_argnums=(0,))
    write_one = jax.jit(_write_one, donate_argnums=(0,))

    def run_form(form):
        if form in ("lean", "undonated"):
            fn = lean if form == "lean" else undonated
            return lambda ids, caches, pos: fn(params, ids, caches, jnp.int32(pos))
        mode, writers = form.split("_")

        def run_step(ids, caches, pos):
            pos = jnp.int32(pos)
            ids, rows = read_only[mode](params, ids, caches, pos)
            if writers == "one":
                return ids, write_all(caches, rows, pos)
            return ids, [(write_one(kc, k, pos), write_one(vc, v, pos)) for (kc, vc), (k, v) in zip(caches, rows)]

        return run_step

    records = []
    out.mkdir(parents=True, exist_ok=True)
    for batch in batches:
        for form in forms:
            shape = (batch, cfg["kv_heads"], cache_len, cfg["head_dim"])
            caches = [(jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)) for _ in range(cfg["layers"])]
            ids = (jnp.arange(batch, dtype=jnp.int32) * 7919 + 13) % cfg["vocab"]
            try:
                seconds, last = _timed(run_form(form), ids, caches, steps)
                record = {"model": "llama-1b", "batch": batch, "form": form, "back_to_back_s": seconds,
                          "last_ids": [int(t) for t in last]}  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a failing form is a record; the next one runs
                record = {"model": "llama-1b", "batch": batch, "form": form,
                          "error": f"{type(exc).__name__}: {str(exc)[:400]}"}  # fmt: skip
            record["device"] = jax.devices()[0].device_kind
            with open(out / "kv_write.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)
            records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--forms", nargs="+", default=FORMS, choices=FORMS)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a check of the script on a CPU)")
    args = parser.parse_args(argv)
    measure(Path(args.out), args.batches, args.forms, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
