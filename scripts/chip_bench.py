"""The chip benchmark: hf_tpu's programs beside a lean JAX step of the same model, the chip's streaming floor and
JAX's megablox ``gmm``, side by side in one run on a TPU.

On a TPU VM with torch-tpu and jax installed, one command does everything (lower, run on the local chip, report)::

    python scripts/chip_bench.py all bench/

Where the chip has no torch (this project's chip machine), the halves run on two machines::

    python scripts/chip_bench.py lower bench/               # anywhere with torch-tpu: hf_tpu's programs as StableHLO
    python scripts/chip_bench.py run bench/ --out $OUT      # on the chip, jax only: every part, records as they come
    python scripts/chip_bench.py report $OUT/records.jsonl --rows docs/chip_v5e.json \
        --table hf_tpu/kernels/experts_v5e.json \
        --torch-tpu-records docs/chip_v5e_torch_tpu.jsonl   # anywhere: rows (with chip_torch_tpu.py's images and
                                                            # training rows), hf_tpu's choice table, a table

``run`` starts each part in a process of its own with its own timeout (a hung or failing program costs only its
part) and appends each measurement to ``records.jsonl`` the moment it is taken. The parts:

- ``floor``: the chip's HBM streaming rate (a bf16 reduction and a matrix-vector product over 2.5 GB; the faster
  counts); every floor is bytes over it.
- ``experts``: one experts layer of Qwen3-30B-A3B, Mixtral-8x7B and gpt-oss-20b at 1, 8, 64, 512 and 2048 tokens
  in every form (hf_tpu's kernel in its decode and visit forms and as megablox; ``lax.ragged_dot``, what
  transformers' grouped_mm lowers to; every expert densely; per-slot products) against megablox ``gmm`` with the
  better of two tilings, and the routed-experts floor. ``report --table`` writes hf_tpu's choice table from them.
- ``lean``: a lean JAX decode step (layers unrolled, donated KV cache, greedy) of a Llama-3.2-1B shape and of a
  Qwen3-30B-A3B shape (8 layers: as many as fit beside a lean copy's temporaries) at batch 1, 8, 64, the MoE in
  each experts form, each step synced and 30 steps dispatched back to back. With ``mmdit`` or ``train`` in
  ``CHIP_BENCH_LEAN``: an SD3.5-medium MMDiT forward at 1024x1024 (batch 1 and 2; on a TPU its attention the
  Pallas flash kernel) and a training step (forward, backward, AdamW, donated) of the Llama-3.2-1B shape, the
  references of chip_torch_tpu.py's ``denoiser`` and ``train`` stages (:func:`part_lean_images`).
- ``programs``: each program ``lower`` wrote (prefill at batch 1, decode at 1, 8, 64; the MoE with each experts form
  torch_tpu lowers), compiled by JAX's TPU client and run on random inputs, synced and back to back; each decode
  program also with its KV caches donated (:func:`donated`: what the step would cost if torch_tpu's runtime
  updated the caches in place; ``CHIP_BENCH_DONATE=0`` leaves that out).

Environment (narrowing a run): ``CHIP_BENCH_TOKENS`` (experts part: token counts), ``CHIP_BENCH_BATCHES``,
``CHIP_BENCH_LEAN`` (lean part: batches; models, "llama moe"), ``CHIP_BENCH_LEAN_FORMS`` (its experts forms),
``CHIP_BENCH_PROGRAMS`` (programs part: ``tag/program`` names, in this order), ``CHIP_BENCH_TIMEOUTS``
(``part=seconds ...``).

Figures from a run are in docs/chip_v5e.json and docs/planning.md ("Measured on a chip").
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "hf_tpu/kernels/hub/ragged-dot-tpu/build/torch-tpu/ragged_dot_tpu/_jax_kernels.py"

# (name, hidden, intermediate, experts, top-k): the experts layers measured
EXPERTS_SHAPES = [
    ("Qwen3-30B-A3B", 2048, 768, 128, 8),
    ("Mixtral-8x7B", 4096, 14336, 8, 2),
    ("gpt-oss-20b", 2880, 2880, 32, 4),
]
TOKENS = [1, 8, 64, 512, 2048]
BATCHES = [1, 8, 64]
LLAMA_1B = {"vocab": 128256, "hidden": 2048, "intermediate": 8192, "layers": 16, "heads": 32, "kv_heads": 8,
            "head_dim": 64, "tied": True}  # fmt: skip
QWEN3_MOE = {"vocab": 151936, "hidden": 2048, "intermediate": 768, "layers": 8, "heads": 32, "kv_heads": 4,
             "head_dim": 128, "experts": 128, "top_k": 8, "tied": False}  # fmt: skip
PROMPT, NEW_TOKENS = 512, 128
# the experts forms hf_tpu lowers through torch_tpu (the kernel's forms go through jax_op, which needs a chip to
# lower: they are measured in the lean step and the experts part instead)
LOWERED_FORMS = {1: ["grouped_mm", "hf_tpu_dense", "hf_tpu_slots"], 8: ["grouped_mm", "hf_tpu_dense", "hf_tpu_slots"],
                 64: ["grouped_mm", "hf_tpu_dense"]}  # fmt: skip
# the one-token attention forms lowered beside hf_tpu's own (grouped products): torch_tpu's flash kernel through
# upstream's sdpa call, as hf_tpu's decode programs were before (hf_tpu/transformers/_decode_attention.py)
OTHER_ATTENTION = ["sdpa"]
REPORTED_ATTENTION = ["sdpa", "packed"]  # packed (upstream's pack_gqa through sdpa): measured once, in the records
DECODE_ATTENTION_ENV = "HF_TPU_DECODE_ATTENTION"
# part -> seconds it may take (process start and TPU init included)
TIMEOUTS = {"floor": 60, "experts": 290, "lean": 220, "programs": 420}


def _record(out: Path, **fields) -> None:
    """Append one record to ``out/records.jsonl`` now (a part killed later keeps what it measured)."""
    line = json.dumps(fields)
    with open(out / "records.jsonl", "a") as f:
        f.write(line + "\n")
    print(line, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# lower (torch-tpu, no chip)
# ----------------------------------------------------------------------------------------------------------------


def write_configs(folder: Path, moe_layers: int) -> dict[str, Path]:
    """config.json of the two model shapes (no weights: the programs take them as arguments)."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    folder.mkdir(parents=True, exist_ok=True)
    llama = LlamaConfig(
        vocab_size=LLAMA_1B["vocab"], hidden_size=LLAMA_1B["hidden"], intermediate_size=LLAMA_1B["intermediate"],
        num_hidden_layers=LLAMA_1B["layers"], num_attention_heads=LLAMA_1B["heads"],
        num_key_value_heads=LLAMA_1B["kv_heads"], head_dim=LLAMA_1B["head_dim"], tie_word_embeddings=True,
        max_position_embeddings=8192, rope_theta=500000.0,
    )  # fmt: skip
    qwen = Qwen3MoeConfig(
        vocab_size=QWEN3_MOE["vocab"], hidden_size=QWEN3_MOE["hidden"],
        moe_intermediate_size=QWEN3_MOE["intermediate"],
        intermediate_size=6144, num_hidden_layers=moe_layers, num_attention_heads=QWEN3_MOE["heads"],
        num_key_value_heads=QWEN3_MOE["kv_heads"], head_dim=QWEN3_MOE["head_dim"], num_experts=QWEN3_MOE["experts"],
        num_experts_per_tok=QWEN3_MOE["top_k"], decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        tie_word_embeddings=False, max_position_embeddings=8192,
    )  # fmt: skip
    paths = {"llama-1b": folder / "llama-1b", f"qwen3-moe-{moe_layers}l": folder / f"qwen3-moe-{moe_layers}l"}
    llama.save_pretrained(paths["llama-1b"])
    qwen.save_pretrained(paths[f"qwen3-moe-{moe_layers}l"])
    return paths


def lower(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    from hf_tpu.tpu_compile import lower_and_compile

    folder = Path(args.folder)
    (folder / "programs").mkdir(parents=True, exist_ok=True)
    models = write_configs(folder / "configs", args.moe_layers)
    jobs = []
    for batch in args.batches:
        moe = f"qwen3-moe-{args.moe_layers}l"
        jobs.append(("llama-1b", batch, None, None))
        for attention in OTHER_ATTENTION:  # the one-token attention forms hf_tpu does not pick, beside its own
            jobs.append(("llama-1b", batch, None, attention))
            jobs.append((moe, batch, DEFAULT_DECODE_PROGRAM[batch], attention))
        for form in LOWERED_FORMS.get(batch, ["grouped_mm", "hf_tpu_dense"]):
            jobs.append((moe, batch, form, None))
    failed = 0
    for model, batch, form, attention in jobs:
        tag = f"{model}-b{batch}" + (f"-{form}" if form else "") + (f"-attn_{attention}" if attention else "")
        path = folder / "programs" / f"{tag}.json"
        if path.exists() and not args.again:
            print(f"{tag}: kept {path}", file=sys.stderr)
            continue
        started = time.perf_counter()
        kwargs = {"model": str(models[model]), "batch": batch, "max_prompt_len": PROMPT, "max_new_tokens": NEW_TOKENS,
                  "dtype": "bfloat16", "experts_implementation": form}  # fmt: skip
        # the lowering child reads the form from its environment (hf_tpu/transformers/_decode_attention.py)
        os.environ.pop(DECODE_ATTENTION_ENV, None)
        if attention:
            os.environ[DECODE_ATTENTION_ENV] = attention
        try:
            result = lower_and_compile("hf_tpu.tpu_compile._generate:lower_generate", kwargs, args.target,
                                       compile=False, timeout=600)  # fmt: skip
        finally:
            os.environ.pop(DECODE_ATTENTION_ENV, None)
        if result.error or not result.programs:
            failed += 1
            print(f"{tag}: lowering failed: {result.error} (at {result.where})", file=sys.stderr)
            continue
        facts = {k: result.info.get(k) for k in ("model_type", "parameters", "weights_bytes", "kv_cache_bytes",
                                                 "gathered_embedding_bytes")}  # fmt: skip
        programs = [{"name": p.name, "text": p.text, "arguments": p.arguments} for p in result.programs
                    if p.lowered and (p.name == "decode" or not attention)]  # fmt: skip
        label = (form or "default") + (f"+attn_{attention}" if attention else "")
        path.write_text(json.dumps({"tag": tag, "model": model, "batch": batch, "form": label,
                                    "facts": facts, "programs": programs}))  # fmt: skip
        print(f"{tag}: {len(programs)} program(s) in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------------------------
# run (jax on the chip)
# ----------------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Each part in a process of its own, with its own timeout; the records are appended as they come."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for part in args.parts:
        started = time.perf_counter()
        cmd = [sys.executable, __file__, "part", part, args.folder, "--out", str(out)]
        if args.quick:
            cmd.append("--quick")
        asked = (kv.split("=") for kv in os.environ.get("CHIP_BENCH_TIMEOUTS", "").split())
        limits = dict(TIMEOUTS, **{k: int(v) for k, v in asked})
        try:
            proc = subprocess.run(cmd, env=env, timeout=limits[part] * (3 if args.quick else 1))
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limits[part]} s"
        _record(out, part=part, status=status, seconds=time.perf_counter() - started)
    return 0


def _kernels():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_ragged_dot_jax_kernels", KERNEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timed(fn, repeats: int) -> dict:
    """First call (compile) apart; ``seconds``: per call with ``repeats`` calls dispatched back to back (the host's
    wait for each result left out, as in a decode loop that does not wait), ``synced_seconds``: the median of
    ``repeats`` calls each waited for."""
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    back_to_back = _back_to_back(fn, repeats)
    return {"seconds": back_to_back, "synced_seconds": statistics.median(times), "min_seconds": min(times),
            "first_call_seconds": first}  # fmt: skip


def part_floor(out: Path, quick: bool) -> None:
    import jax
    import jax.numpy as jnp

    n = (2_471_624_704 if not quick else 1 << 22) // 2
    x = jnp.ones((n // 4096, 4096), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    t = _timed(lambda: total(x), 20)
    _record(out, part="floor", name="hbm-reduction", bytes=n * 2, **t, bytes_per_second=n * 2 / t["seconds"])
    v = jnp.ones((1, x.shape[0]), jnp.bfloat16)
    matvec = jax.jit(lambda v, m: v @ m)
    t = _timed(lambda: matvec(v, x), 20)
    _record(out, part="floor", name="hbm-matvec", bytes=n * 2, **t, bytes_per_second=n * 2 / t["seconds"])


def _routing(rng, tokens, experts, top_k):
    import numpy as np

    index = np.stack([rng.choice(experts, size=top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    return index, weights / weights.sum(1, keepdims=True)


def _slots_experts(hidden, index, weights, gate_up, down):
    """Per-(token, slot) products, each expert's weights by a dynamic slice (the slots form)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    tokens, top_k = index.shape
    rows = []
    for t in range(tokens):
        acc = jnp.zeros((hidden.shape[1],), jnp.float32)
        for j in range(top_k):
            e = index[t, j]
            h = lax.dot_general(lax.dynamic_index_in_dim(gate_up, e, 0, False), hidden[t], (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)  # fmt: skip
            g, u = jnp.split(h, 2)
            a = (jax.nn.silu(g) * u).astype(hidden.dtype)
            y = lax.dot_general(lax.dynamic_index_in_dim(down, e, 0, False), a, (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)  # fmt: skip
            acc = acc + y * weights[t, j].astype(jnp.float32)
        rows.append(acc)
    return jnp.stack(rows).astype(hidden.dtype)


def experts_layer(k, form: str):
    """``fn(hidden, index, weights, gate_up, down)`` of one experts form (transformers' (E, 2I, H) layout)."""
    import jax

    if form == "slots":
        return jax.jit(_slots_experts)
    impl = {"kernel_decode": "pallas_decode", "kernel": "pallas", "ragged_dot": "xla", "dense": "dense",
            "megablox": "megablox"}[form]  # fmt: skip
    return functools.partial(k.moe_experts, rhs_transposed=True, implementation=impl)


def _gmm_layer(tiling):
    """The experts layer with megablox ``gmm`` for both grouped matmuls at one tiling (the reference)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    @jax.jit
    def layer(hidden, index, weights, gate_up, down):
        tokens, top_k = index.shape
        ids = index.reshape(-1)
        order = jnp.argsort(ids, stable=True)
        sizes = jnp.bincount(ids, length=gate_up.shape[0]).astype(jnp.int32)
        x = hidden[order // top_k]
        m = x.shape[0]
        tm = min(tiling[0], -(-m // 16) * 16)
        mp = -(-m // tm) * tm
        x = jnp.pad(x, ((0, mp - m), (0, 0)))
        tk1, tn1 = min(tiling[1], x.shape[1]), min(tiling[2], gate_up.shape[1])
        h = gmm(x, gate_up, sizes, preferred_element_type=jnp.float32, tiling=(tm, tk1, tn1), transpose_rhs=True)
        g, u = jnp.split(h, 2, axis=-1)
        a = (jax.nn.silu(g) * u).astype(x.dtype)
        tk2, tn2 = min(tiling[1], a.shape[1]), min(tiling[2], down.shape[1])
        y = gmm(a, down, sizes, preferred_element_type=jnp.float32, tiling=(tm, tk2, tn2), transpose_rhs=True)[:m]
        y = y * weights.reshape(-1)[order][:, None]
        slots = jnp.zeros_like(y).at[order].set(y)
        return slots.reshape(tokens, top_k, -1).sum(1).astype(hidden.dtype)

    return layer


GMM_TILINGS = [(128, 512, 1024), (128, 1024, 512)]
#: the experts part's timing: rounds over every candidate of a point, each candidate's round at least this long
EXPERTS_ROUNDS = 3
EXPERTS_SPAN_S = 0.03
FORMS = ["kernel_decode", "kernel", "megablox", "ragged_dot", "dense", "slots"]


def _form_applies(form: str, tokens: int, top_k: int) -> bool:
    if form == "slots":
        return tokens * top_k <= 64
    if form == "kernel_decode":
        return tokens * top_k <= 512
    return True


def part_experts(out: Path, quick: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    k = _kernels()
    interpret = jax.devices()[0].platform != "tpu"
    shapes = [("tiny", 256, 128, 8, 2)] if quick else EXPERTS_SHAPES
    tokens_list = [1, 8] if quick else [int(t) for t in os.environ.get("CHIP_BENCH_TOKENS", "").split()] or TOKENS
    rng = np.random.default_rng(0)
    bw = _bandwidth(out)
    weights_of = {}
    for name, hidden, inter, experts, top_k in shapes:  # every shape's weights stay (5.6 GB for the three)
        k1, k2 = jax.random.split(jax.random.PRNGKey(len(weights_of)))
        weights_of[name] = (
            (jax.random.normal(k1, (experts, 2 * inter, hidden), jnp.float32) / np.sqrt(hidden)).astype(jnp.bfloat16),
            (jax.random.normal(k2, (experts, hidden, inter), jnp.float32) / np.sqrt(inter)).astype(jnp.bfloat16),
        )
    k3 = jax.random.PRNGKey(99)
    for tokens in tokens_list:  # small token counts of every shape first: a part cut short keeps the decode sizes
        for name, hidden, inter, experts, top_k in shapes:
            gate_up, down = weights_of[name]
            per_expert = 3 * hidden * inter * 2
            x = jax.random.normal(k3, (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
            index, weights = _routing(rng, tokens, experts, top_k)
            routed = len(set(index.reshape(-1).tolist()))
            args = (x, jnp.asarray(index), jnp.asarray(weights, jnp.bfloat16), gate_up, down)
            floor_s = routed * per_expert / bw
            base = {"part": "experts", "model": name, "tokens": tokens, "hidden": hidden, "intermediate": inter,
                    "experts": experts, "top_k": top_k, "routed_experts": routed, "floor_s": floor_s}  # fmt: skip
            # Every candidate (megablox gmm at each tiling, then each form) compiled and timed once, then timed again
            # in EXPERTS_ROUNDS - 1 more rounds, all candidates in turn: a candidate's time is the median of its rounds'
            # back-to-back times, each round EXPERTS_SPAN_S long or more, so that a drift of the chip or the host
            # during the point touches the reference and the forms alike.
            candidates = [(f"gmm{tiling}", _gmm_layer(tiling)) for tiling in ([] if interpret else GMM_TILINGS)]
            for form in FORMS:
                if not _form_applies(form, tokens, top_k):
                    continue
                fn = experts_layer(k, form)
                if interpret and form in ("kernel_decode", "kernel", "megablox"):
                    impl = {"kernel_decode": "pallas_decode_interpret", "kernel": "pallas_interpret",
                            "megablox": "megablox_interpret"}[form]  # fmt: skip
                    fn = functools.partial(k.moe_experts, rhs_transposed=True, implementation=impl)
                candidates.append((form, fn))
            first, rounds, errors = {}, {}, {}
            for label, fn in candidates:
                try:
                    t = _timed(lambda fn=fn: fn(*args), 10)
                    first[label] = t
                    rounds[label] = [t["seconds"]]
                except Exception as exc:  # noqa: BLE001 - a tiling Mosaic refuses, a form that fails: a record
                    errors[label] = f"{type(exc).__name__}: {str(exc)[:500]}"
            for _ in range(EXPERTS_ROUNDS - 1):
                for label, fn in candidates:
                    if label in rounds:
                        repeats = max(10, min(400, int(EXPERTS_SPAN_S / max(min(rounds[label]), 1e-6))))
                        rounds[label].append(_back_to_back(lambda fn=fn: fn(*args), repeats))
            seconds = {label: statistics.median(times) for label, times in rounds.items()}
            ref = {str(tiling): seconds.get(f"gmm{tiling}") for tiling in ([] if interpret else GMM_TILINGS)}
            for tiling in [] if interpret else GMM_TILINGS:
                if f"gmm{tiling}" in errors:
                    _record(out, **base, form=f"gmm{tiling}", error=errors[f"gmm{tiling}"])
            ref_s = min((v for v in ref.values() if v), default=None)
            _record(out, **base, form="megablox_gmm_reference", measured_s=ref_s, tilings=ref,
                    rounds={str(t): rounds.get(f"gmm{t}") for t in ([] if interpret else GMM_TILINGS)})  # fmt: skip
            want = None
            best_tiling = min((t for t in ([] if interpret else GMM_TILINGS) if ref[str(t)]), default=None,
                              key=lambda t: ref[str(t)])  # fmt: skip
            if best_tiling is not None:
                want = np.asarray(_gmm_layer(best_tiling)(*args), np.float32)
            for label, fn in candidates:
                if label.startswith("gmm"):
                    continue
                if label in errors:
                    _record(out, **base, form=label, error=errors[label])
                    continue
                got = np.asarray(fn(*args), np.float32)
                if want is None:
                    want = got
                diff = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))
                measured = seconds[label]
                ratio = measured / ref_s if ref_s else None
                _record(out, **base, form=label, measured_s=measured, synced_s=first[label]["synced_seconds"],
                        first_call_s=first[label]["first_call_seconds"], rounds=rounds[label], reference_s=ref_s,
                        ratio_to_reference=ratio, ratio_to_floor=measured / floor_s,
                        difference=diff, met=None if ratio is None else ratio <= 1.0)  # fmt: skip


def _back_to_back(fn, repeats: int) -> float:
    """Seconds per call with ``repeats`` calls dispatched back to back (``fn`` compiled already)."""
    import jax

    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    outs = [fn() for _ in range(repeats)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) / repeats


def _bandwidth(out: Path) -> float:
    """The streaming rate the floor part measured in this run (the v5e's 819 GB/s spec where it has not run)."""
    path = out / "records.jsonl"
    rates = []
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("part") == "floor" and "bytes_per_second" in r:
                rates.append(r["bytes_per_second"])
    return max(rates, default=819e9)  # the fastest streaming seen: the floor is what the chip showed it can do


# ----------------------------------------------------------------------------------------------------------------
# the lean JAX step (the reference): layers unrolled, KV cache per layer and donated
# ----------------------------------------------------------------------------------------------------------------


def lean_params(cfg: dict, key, layers: int | None = None):
    import jax
    import jax.numpy as jnp

    h, nh, kvh, hd = cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    layers = layers or cfg["layers"]
    keys = iter(jax.random.split(key, 16 * layers + 4))

    def w(*shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) * 0.02).astype(jnp.bfloat16)

    params = {"embed": w(cfg["vocab"], h), "norm": jnp.ones((h,), jnp.bfloat16), "layers": []}
    if not cfg["tied"]:
        params["head"] = w(cfg["vocab"], h)
    for _ in range(layers):
        layer = {"ln1": jnp.ones((h,), jnp.bfloat16), "ln2": jnp.ones((h,), jnp.bfloat16), "wq": w(h, nh * hd),
                 "wk": w(h, kvh * hd), "wv": w(h, kvh * hd), "wo": w(nh * hd, h)}  # fmt: skip
        if "experts" in cfg:
            e, i = cfg["experts"], cfg["intermediate"]
            layer.update(q_norm=jnp.ones((hd,), jnp.bfloat16), k_norm=jnp.ones((hd,), jnp.bfloat16),
                         router=w(h, e), gate_up=w(e, 2 * i, h), down=w(e, h, i))  # fmt: skip
        else:
            layer.update(gate_up=w(h, 2 * cfg["intermediate"]), down=w(cfg["intermediate"], h))
        params["layers"].append(layer)
    return params


def _rms(x, weight):
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    return (x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6))).astype(x.dtype) * weight


def _rope(x, position, theta=500000.0):
    import jax.numpy as jnp

    hd = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    angle = position.astype(jnp.float32) * inv
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., : hd // 2].astype(jnp.float32), x[..., hd // 2 :].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def lean_step(cfg: dict, experts_fn=None):
    """``step(params, ids (B,), caches, position) -> (next ids, caches)``: one greedy decode step."""
    import jax
    import jax.numpy as jnp

    nh, kvh, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]

    def step(params, ids, caches, position):
        x = params["embed"][ids]  # (B, H)
        b = x.shape[0]
        new_caches = []
        for layer, (kc, vc) in zip(params["layers"], caches):
            h = _rms(x, layer["ln1"])
            q = (h @ layer["wq"]).reshape(b, nh, hd)
            k = (h @ layer["wk"]).reshape(b, kvh, hd)
            v = (h @ layer["wv"]).reshape(b, kvh, hd)
            if "q_norm" in layer:
                q, k = _rms(q, layer["q_norm"]), _rms(k, layer["k_norm"])
            q, k = _rope(q, position), _rope(k, position)
            kc = jax.lax.dynamic_update_slice(kc, k[:, :, None, :], (0, 0, position, 0))
            vc = jax.lax.dynamic_update_slice(vc, v[:, :, None, :], (0, 0, position, 0))
            new_caches.append((kc, vc))
            qg = q.reshape(b, kvh, nh // kvh, hd)
            s = jnp.einsum("bkgd,bksd->bkgs", qg, kc, preferred_element_type=jnp.float32) / jnp.sqrt(hd)
            s = jnp.where(jnp.arange(kc.shape[2]) <= position, s, -1e30)
            p = jax.nn.softmax(s, axis=-1).astype(x.dtype)
            o = jnp.einsum("bkgs,bksd->bkgd", p, vc).reshape(b, nh * hd)
            x = x + o @ layer["wo"]
            h = _rms(x, layer["ln2"])
            if "router" in layer:
                logits = (h @ layer["router"]).astype(jnp.float32)
                weights, index = jax.lax.top_k(jax.nn.softmax(logits, -1), cfg["top_k"])
                weights = (weights / weights.sum(-1, keepdims=True)).astype(x.dtype)
                x = x + experts_fn(h, index.astype(jnp.int32), weights, layer["gate_up"], layer["down"])
            else:
                g, u = jnp.split(h @ layer["gate_up"], 2, -1)
                x = x + (jax.nn.silu(g) * u) @ layer["down"]
        x = _rms(x, params["norm"])
        head = params.get("head", params["embed"])
        logits = jnp.einsum("bh,vh->bv", x, head, preferred_element_type=jnp.float32)
        return jnp.argmax(logits, -1).astype(jnp.int32), new_caches

    return jax.jit(step, donate_argnums=(2,))


def lean_bytes(cfg: dict, batch: int, cache_len: int, layers: int) -> dict:
    """Bytes a decode step must read: the weights it uses (for a MoE the expected routed experts of ``batch`` random
    tokens, and all of them), the KV cache, the head; an embedding row per token is negligible."""
    h, nh, kvh, hd = cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    attention = (2 * h * nh * hd + 2 * h * kvh * hd) * 2
    kv = 2 * batch * kvh * cache_len * hd * 2
    head = cfg["vocab"] * h * 2
    if "experts" in cfg:
        e, k, i = cfg["experts"], cfg["top_k"], cfg["intermediate"]
        expected = e * (1 - (1 - k / e) ** batch)
        expert = 3 * h * i * 2
        base = layers * (attention + h * e * 2 + kv) + head
        return {"routed": base + layers * expected * expert, "all_experts": base + layers * e * expert}
    return {"all": layers * (attention + 3 * h * cfg["intermediate"] * 2 + kv) + head}


def _step_times(step, params, ids, caches, steps: int) -> tuple[float, float]:
    """(synced, back-to-back) seconds per step; the position advances, the caches are donated through."""
    import jax
    import jax.numpy as jnp

    ids, caches = step(params, ids, caches, jnp.int32(0))  # compile
    jax.block_until_ready(ids)
    synced = []
    for pos in range(1, steps + 1):
        t0 = time.perf_counter()
        ids, caches = step(params, ids, caches, jnp.int32(pos))
        jax.block_until_ready(ids)
        synced.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for pos in range(steps + 1, 2 * steps + 1):
        ids, caches = step(params, ids, caches, jnp.int32(pos))
    jax.block_until_ready((ids, caches))
    return statistics.median(synced), (time.perf_counter() - t0) / steps


def part_lean(out: Path, folder: Path, quick: bool) -> None:
    import jax
    import jax.numpy as jnp

    k = _kernels()
    bw = _bandwidth(out)
    cache_len = PROMPT + NEW_TOKENS
    steps = 4 if quick else 30
    on_tpu = jax.devices()[0].platform == "tpu"
    llama = dict(LLAMA_1B, layers=2, vocab=512, hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=32) \
        if quick else LLAMA_1B  # fmt: skip
    moe = dict(QWEN3_MOE, layers=2, vocab=512, hidden=128, intermediate=64, heads=4, kv_heads=2, head_dim=32,
               experts=16) if quick else QWEN3_MOE  # fmt: skip
    batches = [int(b) for b in os.environ.get("CHIP_BENCH_BATCHES", "").split()] or BATCHES
    models = os.environ.get("CHIP_BENCH_LEAN", "llama moe").split()
    runs = [("llama-1b", llama, None, b) for b in batches if "llama" in models]
    for b in batches if "moe" in models else []:
        lean_forms = os.environ.get("CHIP_BENCH_LEAN_FORMS", "kernel_decode dense megablox ragged_dot slots kernel")
        for form in lean_forms.split():
            if _form_applies(form, b, moe["top_k"]):
                runs.append((f"qwen3-moe-{moe['layers']}l", moe, form, b))
    if "mmdit" in models or "train" in models:
        part_lean_images(out, quick)
    params = {}
    for name, cfg, form, batch in runs:
        if name not in params:
            params.clear()
            params[name] = lean_params(cfg, jax.random.PRNGKey(1))
        fn = None
        if form is not None:
            fn = experts_layer(k, form)
            if not on_tpu and form in ("kernel_decode", "kernel", "megablox"):
                impl = {"kernel_decode": "pallas_decode_interpret", "kernel": "pallas_interpret",
                        "megablox": "megablox_interpret"}[form]  # fmt: skip
                fn = functools.partial(k.moe_experts, rhs_transposed=True, implementation=impl)
        caches = [(jnp.zeros((batch, cfg["kv_heads"], cache_len, cfg["head_dim"]), jnp.bfloat16),) * 2
                  for _ in range(cfg["layers"])]  # fmt: skip
        caches = [(a, jnp.zeros_like(a)) for a, _ in caches]
        ids = (jnp.arange(batch, dtype=jnp.int32) * 7919 + 13) % cfg["vocab"]  # distinct tokens: distinct routing
        floors = {key: v / bw for key, v in lean_bytes(cfg, batch, cache_len, cfg["layers"]).items()}
        try:
            synced, back_to_back = _step_times(lean_step(cfg, fn), params[name], ids, caches, steps)
            _record(out, part="lean", model=name, batch=batch, form=form or "dense-mlp", synced_s=synced,
                    back_to_back_s=back_to_back, floors_s=floors)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a failing step is a record; the next one runs
            _record(out, part="lean", model=name, batch=batch, form=form or "dense-mlp",
                    error=f"{type(exc).__name__}: {str(exc)[:500]}")  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# the lean JAX references of the images and training stages (scripts/chip_torch_tpu.py's denoiser and train):
# an MMDiT forward step and a Llama training step (forward, backward, AdamW), each one jitted program
# ----------------------------------------------------------------------------------------------------------------

# SD3.5-medium's transformer in diffusers' field names (chip_torch_tpu.SD35_MEDIUM; the test holds them equal)
SD35_MEDIUM = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24, "attention_head_dim": 64,
               "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
               "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 384,
               "dual_attention_layers": tuple(range(13)), "qk_norm": "rms_norm"}  # fmt: skip
TINY_MMDIT = dict(SD35_MEDIUM, num_layers=3, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=64,
                  caption_projection_dim=32, pooled_projection_dim=32, dual_attention_layers=(0,))  # fmt: skip


def _flops_module():
    """scripts/chip_torch_tpu.py, whose FLOPs counts (plain Python) the lean records use: the same numbers as the
    torch_tpu stages' records."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chip_torch_tpu", ROOT / "scripts" / "chip_torch_tpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mmdit_params(cfg: dict, key, text_width: int | None = None):
    """Random bf16 weights of an SD3 MMDiT ``cfg`` (biases left out: they add no matmul)."""
    import jax
    import jax.numpy as jnp

    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    p, c, layers = cfg["patch_size"], cfg["in_channels"], cfg["num_layers"]
    keys = iter(jax.random.split(key, 32 * layers + 16))

    def w(*shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) * 0.02).astype(jnp.bfloat16)

    params = {"patch": w(c * p * p, d), "t1": w(256, d), "t2": w(d, d), "y1": w(cfg["pooled_projection_dim"], d),
              "y2": w(d, d), "ctx": w(text_width or cfg["joint_attention_dim"], cfg["caption_projection_dim"]),
              "out_mod": w(d, 2 * d), "out": w(d, p * p * cfg["out_channels"]), "blocks": []}  # fmt: skip
    for i in range(layers):
        dual, last = i in cfg["dual_attention_layers"], i == layers - 1
        block = {"mod": w(d, 9 * d if dual else 6 * d), "cmod": w(d, 2 * d if last else 6 * d), "qkv": w(d, 3 * d),
                 "cqkv": w(d, 3 * d), "o": w(d, d), "ff1": w(d, 4 * d), "ff2": w(4 * d, d)}  # fmt: skip
        if not last:
            block.update(co=w(d, d), cff1=w(d, 4 * d), cff2=w(4 * d, d))
        if dual:
            block.update(qkv2=w(d, 3 * d), o2=w(d, d))
        params["blocks"].append(block)
    return params


def _ln(x):
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) / jnp.sqrt(var + 1e-6)).astype(x.dtype)


def _attend(q, k, v, heads: int, causal: bool = False):
    """Multi-head attention of (B, S, heads x hd) rows (k/v may have fewer heads: grouped), q and k RMS-normed by
    the caller where the model does; float32 scores."""
    import jax
    import jax.numpy as jnp

    b, s, _ = q.shape
    q = q.reshape(b, s, heads, -1)
    hd = q.shape[-1]
    kv_heads = k.shape[-1] // hd
    k, v = k.reshape(b, -1, kv_heads, hd), v.reshape(b, -1, kv_heads, hd)
    q = q.reshape(b, s, kv_heads, heads // kv_heads, hd)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(hd)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((s, k.shape[1]), bool)), scores, -1e30)
    weights = jax.nn.softmax(scores, -1).astype(v.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", weights, v).reshape(b, s, heads * hd)


def _flash_attend(q, k, v, heads: int, block: int = 512):
    """:func:`_attend` (not causal, as many k/v heads as q heads) through the Pallas TPU flash kernel
    (``jax.experimental.pallas.ops.tpu.flash_attention``, [B, heads, S, hd] blocks of ``block`` rows, of 128 where
    the sequence is shorter): the sequence padded up to a multiple of the block, the padding a segment of its own
    (id 1) so that no real query gives a padded key weight, the padded rows dropped after."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    b, s, _ = q.shape
    blk = min(block, -(-s // 128) * 128)
    pad = -s % blk

    def heads_first(x):
        return jnp.pad(x.reshape(b, s, heads, -1), ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    segments = jnp.broadcast_to(jnp.arange(s + pad) >= s, (b, s + pad)).astype(jnp.int32)
    segments = fa.SegmentIds(segments, segments) if pad else None
    sizes = fa.BlockSizes(block_q=blk, block_k_major=blk, block_k=blk, block_b=1)
    out = fa.flash_attention(*map(heads_first, (q, k, v)), segment_ids=segments,
                             sm_scale=(q.shape[-1] // heads) ** -0.5, block_sizes=sizes)
    return out.transpose(0, 2, 1, 3)[:, :s].reshape(b, s, -1)


def mmdit_forward(cfg: dict, attn: str = "plain", block: int = 512):
    """``forward(params, latents (B, C, H, W), text (B, T, joint), pooled (B, P), t (B,)) -> (B, C, H, W)``: SD3's
    MMDiT (MMDiT-X blocks with a second, image-only attention; RMS-normed q/k) in bf16, every matmul of
    ``SD3Transformer2DModel`` (the same FLOPs); the position table left out (an addition). ``attn``: "plain"
    (:func:`_attend`, softmax(QK^T)V in XLA; ``jax.nn.dot_product_attention`` is no better on a TPU: with
    ``implementation=None`` it lowers to the same XLA attention) or "flash" (:func:`_flash_attend` with ``block``;
    the TPU kernel, on CPU only under ``pltpu.force_tpu_interpret_mode``)."""
    import jax
    import jax.numpy as jnp

    if attn not in ("plain", "flash"):
        raise ValueError(f"attention {attn!r}: plain or flash")
    heads, p = cfg["num_attention_heads"], cfg["patch_size"]
    dual_layers = set(cfg["dual_attention_layers"])

    def qk_norm(x):
        b, s, _ = x.shape
        x32 = x.reshape(b, s, heads, -1).astype(jnp.float32)
        return (x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + 1e-6)).astype(x.dtype).reshape(b, s, -1)

    def attention(h, w_qkv, ctx=None, w_cqkv=None):
        q, k, v = jnp.split(h @ w_qkv, 3, -1)
        q, k = qk_norm(q), qk_norm(k)
        if ctx is not None:
            cq, ck, cv = jnp.split(ctx @ w_cqkv, 3, -1)
            q, k, v = (jnp.concatenate([q, qk_norm(cq)], 1), jnp.concatenate([k, qk_norm(ck)], 1),
                       jnp.concatenate([v, cv], 1))
        return _flash_attend(q, k, v, heads, block) if attn == "flash" else _attend(q, k, v, heads)

    def modulate(x, shift, scale):
        return _ln(x) * (1 + scale[:, None]) + shift[:, None]

    def forward(params, latents, text, pooled, t):
        b, c, hh, ww = latents.shape
        patches = latents.reshape(b, c, hh // p, p, ww // p, p).transpose(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
        x = patches @ params["patch"]
        n = x.shape[1]
        half = jnp.exp(-jnp.log(10000.0) * jnp.arange(128, dtype=jnp.float32) / 128)
        freqs = t.astype(jnp.float32)[:, None] * half[None]
        temb = jnp.concatenate([jnp.cos(freqs), jnp.sin(freqs)], -1).astype(x.dtype)
        temb = jax.nn.silu(temb @ params["t1"]) @ params["t2"]
        cond = temb + jax.nn.silu(pooled @ params["y1"]) @ params["y2"]
        act = jax.nn.silu(cond)
        ctx = text @ params["ctx"]
        for i, blk in enumerate(params["blocks"]):
            mod = jnp.split(act @ blk["mod"], 9 if i in dual_layers else 6, -1)
            last = "co" not in blk
            cmod = jnp.split(act @ blk["cmod"], 2 if last else 6, -1)
            h = modulate(x, mod[0], mod[1])
            h2 = modulate(x, mod[6], mod[7]) if i in dual_layers else None
            ch = modulate(ctx, cmod[1], cmod[0]) if last else modulate(ctx, cmod[0], cmod[1])
            joint = attention(h, blk["qkv"], ch, blk["cqkv"])
            x = x + mod[2][:, None] * (joint[:, :n] @ blk["o"])
            if i in dual_layers:
                x = x + mod[8][:, None] * (attention(h2, blk["qkv2"]) @ blk["o2"])
            h = modulate(x, mod[3], mod[4])
            x = x + mod[5][:, None] * (jax.nn.gelu(h @ blk["ff1"], approximate=True) @ blk["ff2"])
            if not last:
                ctx = ctx + cmod[2][:, None] * (joint[:, n:] @ blk["co"])
                ch = modulate(ctx, cmod[3], cmod[4])
                ctx = ctx + cmod[5][:, None] * (jax.nn.gelu(ch @ blk["cff1"], approximate=True) @ blk["cff2"])
        scale, shift = jnp.split(act @ params["out_mod"], 2, -1)
        x = modulate(x, shift, scale) @ params["out"]
        x = x.reshape(b, hh // p, ww // p, p, p, -1).transpose(0, 5, 1, 3, 2, 4)
        return x.reshape(b, -1, hh, ww)

    return forward


def lean_train_step(cfg: dict, lr: float = 1e-4, clip: float = 1.0):
    """``step(params, opt_state, ids (B, S)) -> (params, opt_state, loss)``: a Llama ``cfg`` (:func:`lean_params`)
    forward over every token (causal, grouped attention, rotary positions, the LM head over every token), next-token
    cross entropy, its gradient, global-norm clipping at ``clip`` and AdamW (``lr``, betas 0.9/0.999, eps 1e-8, no
    weight decay: the Trainer's defaults) with the moments kept in the weights' dtype, as torch's AdamW does for bf16
    weights; params and state donated."""
    import jax
    import jax.numpy as jnp

    nh, kvh, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]

    def loss_fn(params, ids):
        b, s = ids.shape
        x = params["embed"][ids]
        position = jnp.arange(s)[:, None, None]
        for layer in params["layers"]:
            h = _rms(x, layer["ln1"])
            q = _rope((h @ layer["wq"]).reshape(b, s, nh, hd), position).reshape(b, s, nh * hd)
            k = _rope((h @ layer["wk"]).reshape(b, s, kvh, hd), position).reshape(b, s, kvh * hd)
            x = x + _attend(q, k, h @ layer["wv"], nh, causal=True) @ layer["wo"]
            g, u = jnp.split(_rms(x, layer["ln2"]) @ layer["gate_up"], 2, -1)
            x = x + (jax.nn.silu(g) * u) @ layer["down"]
        x = _rms(x, params["norm"])
        logits = jnp.einsum("bsh,vh->bsv", x, params.get("head", params["embed"]), preferred_element_type=jnp.float32)
        logp = jax.nn.log_softmax(logits[:, :-1], -1)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean()

    def step(params, opt_state, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids)
        leaves = jax.tree_util.tree_leaves(grads)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves))
        factor = jnp.minimum(1.0, clip / (norm + 1e-6))
        count = opt_state["count"] + 1
        c1, c2 = 1 - 0.9**count, 1 - 0.999**count

        def update(p, g, m, v):
            g = g.astype(jnp.float32) * factor
            m = 0.9 * m.astype(jnp.float32) + 0.1 * g
            v = 0.999 * v.astype(jnp.float32) + 0.001 * g * g
            new = p.astype(jnp.float32) - lr * (m / c1) / (jnp.sqrt(v / c2) + 1e-8)
            return new.astype(p.dtype), m.astype(p.dtype), v.astype(p.dtype)

        out = jax.tree_util.tree_map(update, params, grads, opt_state["m"], opt_state["v"])
        treedef = jax.tree_util.tree_structure(params)
        p, m, v = (treedef.unflatten(column) for column in zip(*treedef.flatten_up_to(out), strict=True))
        return p, {"m": m, "v": v, "count": count}, loss

    return jax.jit(step, donate_argnums=(0, 1))


def _cost_flops(compiled) -> float | None:
    """XLA's own FLOPs count of a compiled program (``cost_analysis``), where it gives one."""
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost["flops"])
    except Exception:  # noqa: BLE001 - not every backend answers
        return None


def _ints(name: str, default: str) -> list[int]:
    return [int(v) for v in os.environ.get(name, default).replace("_", " ").split()]


def part_lean_images(out: Path, quick: bool) -> None:
    """The lean references of chip_torch_tpu.py's ``denoiser`` and ``train`` stages (``CHIP_BENCH_LEAN`` holding
    ``mmdit`` and/or ``train``): the MMDiT forward of SD3.5-medium's shape at ``LEAN_SIZE`` (1024) pixels, 333 text
    tokens, per batch (``LEAN_MMDIT_BATCHES``, "1 2"; ``LEAN_MMDIT_LAYERS``; ``LEAN_ATTENTION`` plain or flash, flash
    on a TPU, ``LEAN_FLASH_BLOCK`` 512: :func:`mmdit_forward`, the record's ``attention``), and a training step of the
    Llama-3.2-1B shape (``LEAN_TRAIN_LAYERS``, 16; ``LEAN_TRAIN_BATCH`` 1, ``LEAN_TRAIN_SEQ`` 1024): seconds per step
    (3 rounds of back-to-back calls, the best), the FLOPs the torch_tpu stages count for the same shape (the flash
    kernel's padding not counted) and XLA's own count."""
    import types

    import jax
    import jax.numpy as jnp

    flops = _flops_module()
    models = os.environ.get("CHIP_BENCH_LEAN", "mmdit train").split()
    rounds, calls = (1, 2) if quick else (3, int(os.environ.get("LEAN_CALLS", "5")))

    def timed(fn, state):
        state = fn(*state)  # the first (compiling) call apart; each call's outputs feed the next
        jax.block_until_ready(state)
        best = None
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                state = fn(*state)
            jax.block_until_ready(state)
            best = min(best or 1e9, (time.perf_counter() - t0) / calls)
        return best

    if "mmdit" in models:
        cfg = dict(TINY_MMDIT if quick else SD35_MEDIUM)
        if "LEAN_MMDIT_LAYERS" in os.environ:
            layers = int(os.environ["LEAN_MMDIT_LAYERS"])
            dual = tuple(i for i in cfg["dual_attention_layers"] if i < layers)
            cfg.update(num_layers=layers, dual_attention_layers=dual)
        size = 32 if quick else int(os.environ.get("LEAN_SIZE", "1024"))
        text_tokens = 93 if quick else 333
        params = mmdit_params(cfg, jax.random.PRNGKey(0))
        attn = os.environ.get("LEAN_ATTENTION") or ("flash" if jax.devices()[0].platform == "tpu" else "plain")
        block = int(os.environ.get("LEAN_FLASH_BLOCK", "512"))
        attention = f"flash (block {block})" if attn == "flash" else attn
        forward = mmdit_forward(cfg, attn, block)
        for batch in _ints("LEAN_MMDIT_BATCHES", "1 2"):
            latent = size // 8
            key = jax.random.split(jax.random.PRNGKey(batch), 3)
            latents = jax.random.normal(key[0], (batch, cfg["in_channels"], latent, latent), jnp.bfloat16)
            text = jax.random.normal(key[1], (batch, text_tokens, cfg["joint_attention_dim"]), jnp.bfloat16)
            pooled = jax.random.normal(key[2], (batch, cfg["pooled_projection_dim"]), jnp.bfloat16)
            t = jnp.full((batch,), 500.0, jnp.float32)
            count = flops.mmdit_flops(cfg, latent, latent, text_tokens, batch)
            try:
                compiled = jax.jit(forward).lower(params, latents, text, pooled, t).compile()
                # the step's output is the next step's latents: back-to-back calls depend on each other, as steps do
                seconds = timed(lambda p, z, c, y, s, fn=compiled: (p, fn(p, z, c, y, s), c, y, s),
                                (params, latents, text, pooled, t))  # fmt: skip
                _record(out, part="lean", model="mmdit", shape=cfg, batch=batch, size=size, text_tokens=text_tokens,
                        attention=attention, seconds=seconds, flops=count, xla_flops=_cost_flops(compiled),
                        flops_per_s=count["total"] / seconds)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a failing step is a record; the next one runs
                _record(out, part="lean", model="mmdit", batch=batch, attention=attention,
                        error=f"{type(exc).__name__}: {str(exc)[:500]}")  # fmt: skip
        params = forward = None
    if "train" in models:
        quick_cfg = dict(LLAMA_1B, layers=2, vocab=512, hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=32)
        cfg = dict(quick_cfg if quick else LLAMA_1B)
        cfg["layers"] = int(os.environ.get("LEAN_TRAIN_LAYERS", cfg["layers"])) if not quick else cfg["layers"]
        batch = 2 if quick else int(os.environ.get("LEAN_TRAIN_BATCH", "1"))
        seq = 32 if quick else int(os.environ.get("LEAN_TRAIN_SEQ", "1024"))
        config = types.SimpleNamespace(hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
                                       num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
                                       head_dim=cfg["head_dim"], intermediate_size=cfg["intermediate"],
                                       vocab_size=cfg["vocab"])  # fmt: skip
        count = flops.train_flops(config, batch, seq)
        try:
            params = lean_params(cfg, jax.random.PRNGKey(2))
            zeros = lambda tree: jax.tree_util.tree_map(jnp.zeros_like, tree)  # noqa: E731
            opt_state = {"m": zeros(params), "v": zeros(params), "count": jnp.int32(0)}
            ids = jax.random.randint(jax.random.PRNGKey(3), (batch, seq), 3, cfg["vocab"], jnp.int32)
            step = lean_train_step(cfg)
            compiled = step.lower(params, opt_state, ids).compile()
            losses = []

            def call(p, o, i):
                p, o, loss = compiled(p, o, i)
                losses.append(loss)
                return p, o, i

            seconds = timed(call, (params, opt_state, ids))
            _record(out, part="lean", model="llama-train", layers=cfg["layers"], batch=batch, seq=seq, seconds=seconds,
                    tokens_per_s=batch * seq / seconds, flops=count, xla_flops=_cost_flops(compiled),
                    flops_per_s=count["total"] / seconds, first_loss=float(losses[0]),
                    last_loss=float(losses[-1]))  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            _record(out, part="lean", model="llama-train", error=f"{type(exc).__name__}: {str(exc)[:500]}")


# ----------------------------------------------------------------------------------------------------------------
# hf_tpu's programs (lowered by `lower`), through JAX's TPU client
# ----------------------------------------------------------------------------------------------------------------


def _signature(text: str) -> tuple[int, int, list[str], list[str]]:
    """The span of ``@main``'s argument list in ``text``, its argument types and its result types."""
    import re

    start = text.index("func.func @main(") if "func.func @main(" in text else text.index("func.func public @main(")
    head = text.index("(", start) + 1
    depth, i = 1, head
    while depth:  # the argument list's closing parenthesis (types hold no parentheses; attributes may)
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    args = re.findall(r"%arg\d+: (tensor<[^>]*>)", text[head : i - 1])
    results = text[i : text.index("{\n", i)]
    return head, i - 1, args, re.findall(r"tensor<[^>]*>", results)


def donated(text: str) -> tuple[str, list[tuple[int, int]]]:
    """The decode program with its KV caches donated, as a runtime that donates them would compile it.

    hf_tpu's decode program takes each layer's K and V cache (rank-4 arguments: batch, heads, slots, dim) and returns
    the updated ones first among its results, in argument order (AOTAutograd's outputs for mutated inputs). The k-th
    rank-4 result of a type is aliased to the k-th rank-4 argument of that type (``tf.aliasing_output``), so XLA
    updates the cache in place instead of writing a new one. Returns the text and the (argument, result) pairs.
    """
    head, end, args, results = _signature(text)
    rank4 = lambda t: t.count("x") == 4  # noqa: E731 - four dims and the element type
    by_type: dict[str, list[int]] = {}
    for j, t in enumerate(results):
        if rank4(t):
            by_type.setdefault(t, []).append(j)
    pairs, seen = [], {}
    for a, t in enumerate(args):
        if rank4(t) and seen.get(t, 0) < len(by_type.get(t, [])):
            pairs.append((a, by_type[t][seen.get(t, 0)]))
            seen[t] = seen.get(t, 0) + 1
    signature = text[head:end]
    for a, j in pairs:
        old = f"%arg{a}: {args[a]}"
        assert signature.count(old + ",") + signature.endswith(old) == 1, old
        signature = signature.replace(old, f"{old} {{tf.aliasing_output = {j} : i32}}", 1)
    return text[:head] + signature + text[end:], pairs


def rows_after(text: str) -> list[tuple[int, int, int]]:
    """The writes a decode program that leaves its KV cache unwritten asks for after it runs
    (``HF_TPU_KV_WRITE``: hf_tpu's loop writes each layer's new K and V row with an in-place ``index_copy_``).

    Such a program returns, per layer, its K row, its V row (rank-4, one slot: batch, heads, 1, dim) and their slot
    (``tensor<1xi64>``, then the same slot as ``tensor<1xi32>`` for hf_tpu's JAX rows writer), in layer order, and
    takes the caches (rank-4, the same batch, heads and dim, many slots) as arguments in that order. Returns (cache
    argument, row result, slot result) per cache tensor; none for a program that writes its cache itself."""
    _, _, args, results = _signature(text)

    def dims(t):
        parts = t[len("tensor<") : -1].split("x")
        return [int(p) for p in parts[:-1]] if len(parts) == 5 else None

    is_row = lambda t: dims(t) is not None and dims(t)[2] == 1  # noqa: E731
    triples = [(j, j + 1, j + 2) for j in range(len(results) - 2)
               if is_row(results[j]) and is_row(results[j + 1]) and results[j + 2] == "tensor<1xi64>"]  # fmt: skip
    rows = [(r, slot) for k, v, slot in triples for r in (k, v)]
    if not rows:
        return []
    caches = [a for a, t in enumerate(args)
              if dims(t) and dims(t)[2] > 1 and any(dims(t)[:2] + dims(t)[3:] == dims(results[j])[:2] + dims(results[j])[3:]
                                                    for j, _ in rows)]  # fmt: skip
    if len(caches) != len(rows):
        return []
    return [(a, j, slot) for a, (j, slot) in zip(caches, rows)]


def part_programs(out: Path, folder: Path, quick: bool) -> None:
    import importlib.util

    import jax

    jax.config.update("jax_enable_x64", True)  # the programs take int64 ids and positions, as torch does
    import jax.extend.backend
    import jax.numpy as jnp
    import numpy as np
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    spec = importlib.util.spec_from_file_location("_hf_tpu_xla", ROOT / "hf_tpu" / "tpu_compile" / "_xla.py")
    xla = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(xla)
    backend = jax.extend.backend.get_backend()
    device = backend.devices()[0]
    def priority(path):  # hf_tpu's default choices first, then the dense model, then the other forms
        default = any(path.stem.endswith(f"-b{b}-{form}") for b, form in DEFAULT_DECODE_PROGRAM.items())
        return (not default, "llama" not in path.stem, path.stem)

    files = sorted((folder / "programs").glob("*.json"), key=priority)
    steps = 3 if quick else 20
    wanted = os.environ.get("CHIP_BENCH_PROGRAMS", "").split()  # "tag/program" names; all when unset
    order = {name: i for i, name in enumerate(wanted)}
    jobs = []
    for path in files:
        data = json.loads(path.read_text())
        for program in data["programs"]:
            name = f"{data['tag']}/{program['name']}"
            if wanted and name not in order:
                continue
            if not wanted and program["name"].startswith("prefill") and data["batch"] != 1:
                continue  # prefill is timed at batch 1; the larger batches' programs here are their decodes
            jobs.append((order.get(name, 0), data, program, False))
            if program["name"] == "decode" and os.environ.get("CHIP_BENCH_DONATE", "1") != "0" and not rows_after(
                    program["text"]):  # fmt: skip
                jobs.append((order.get(name, 0), data, program, True))  # and with its caches donated
    jobs.sort(key=lambda j: j[0])
    for _, data, program, donate in jobs:
        base = {"part": "programs", "tag": data["tag"] + ("-donated" if donate else ""), "model": data["model"],
                "batch": data["batch"], "form": data["form"] + ("+donated" if donate else ""),
                "program": program["name"], "facts": data["facts"]}  # fmt: skip
        text, pairs = donated(program["text"]) if donate else (program["text"], [])
        writes = rows_after(text)
        if writes:
            base["kv_write"] = "after the program: one donated write per cache tensor, as hf_tpu's in-place index_copy_"
        try:
            t0 = time.perf_counter()
            with jax_mlir.make_ir_context():
                module = ir.Module.parse(xla.normalize(text))
                executable = backend.compile_and_load(module, xla_client.DeviceList((device,)),
                                                      xla_client.CompileOptions())  # fmt: skip
            compile_s = time.perf_counter() - t0
            key = jax.random.PRNGKey(0)
            arrays = []
            for i, (shape, dtype) in enumerate(program["arguments"]):
                dt = jnp.dtype(dtype)
                if jnp.issubdtype(dt, jnp.floating):
                    a = (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * 0.02).astype(dt)
                elif dt == jnp.bool_:
                    a = jnp.ones(shape, dt)  # masks: every position valid
                else:  # ids and positions: distinct per row (a MoE's rows then route apart), inside every bound
                    a = jax.random.randint(jax.random.fold_in(key, i), shape, 0, 128).astype(dt)
                arrays.append(jax.device_put(a, device))

            write = jax.jit(lambda cache, row, slot: jax.lax.dynamic_update_slice(cache, row, (0, 0, slot[0], 0)),
                            donate_argnums=(0,))  # fmt: skip

            def call(arrays=arrays, executable=executable, pairs=pairs, writes=writes):
                outs = executable.execute(arrays)
                for a, j in pairs:  # a donated cache is gone: the next step takes the updated one, as a runtime does
                    arrays[a] = outs[j]
                for a, j, p in writes:  # the rows the program left: written in place, one program per cache tensor
                    arrays[a] = write(arrays[a], outs[j], outs[p])
                return [*outs, *(arrays[a] for a, _, _ in writes)]

            outs = call()
            for o in outs:
                o.block_until_ready()
            synced = []
            for _ in range(steps):
                t1 = time.perf_counter()
                for o in call():
                    o.block_until_ready()
                synced.append(time.perf_counter() - t1)
            t1 = time.perf_counter()
            for _ in range(steps):
                outs = call()
            for o in outs:
                o.block_until_ready()
            back_to_back = (time.perf_counter() - t1) / steps
            _record(out, **base, compile_s=compile_s, synced_s=statistics.median(synced),
                    back_to_back_s=back_to_back)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a program that fails on the chip is a record
            _record(out, **base, error=f"{type(exc).__name__}: {str(exc)[:800]}")
        finally:  # this program's weights (up to 11 GB) leave the chip before the next one's arrive
            arrays = outs = executable = call = None


PARTS = {"lean": part_lean, "programs": part_programs}


# ----------------------------------------------------------------------------------------------------------------
# report: the records as rows (docs/chip_v5e.json), hf_tpu's choice table (experts_v5e.json) and a markdown table
# ----------------------------------------------------------------------------------------------------------------

# the table's name of each form measured in the experts part (``ragged_dot`` is ``lax.ragged_dot``: the op
# transformers' grouped_mm lowers to through torch_tpu, chlo.ragged_dot)
TABLE_FORMS = {"slots": "slots", "dense": "dense", "ragged_dot": "grouped_mm", "kernel_decode": "kernel_decode",
               "kernel": "kernel", "megablox": "megablox"}  # fmt: skip
DEFAULT_DECODE_PROGRAM = {1: "hf_tpu_slots", 8: "hf_tpu_slots", 64: "hf_tpu_dense"}


def _load(paths: list[str]) -> list[dict]:
    records = []
    for run, path in enumerate(paths):
        for line in Path(path).read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                record.setdefault("run", run)
                records.append(record)
    return records


def _latest(records, part, key):
    """The last record of each key (a later run replaces an earlier one), errors left out."""
    found = {}
    for r in records:
        if r.get("part") == part and "error" not in r and "status" not in r and key(r) is not None:
            found[key(r)] = r
    return found


def _top_k(model: str) -> int:
    return next(shape[4] for shape in EXPERTS_SHAPES if shape[0] == model)


def torch_tpu_rows(records: list[dict]) -> list[dict]:
    """Rows of ``scripts/chip_torch_tpu.py``'s images and training stages (issue #68; its records carry ``stage`` and
    ``step``, docs/chip_v5e_torch_tpu.jsonl): the denoiser's step per batch against the lean JAX MMDiT forward of the
    same shape measured in the same command, the VAE's decode, and the Trainer's steps against the lean JAX training
    step, each with its fraction of the bf16 matmul rate measured in its stage (the floor: its FLOPs at that rate). The
    latest run that has each row wins."""
    by_step: dict = {}
    for r in records:
        if "stage" in r and "step" in r:
            by_step.setdefault((r["stage"], r["step"]), []).append(r)

    def latest(stage, step, key):
        found: dict = {}
        for r in by_step.get((stage, step), []):
            found[key(r)] = r  # (records are in run order: a later one replaces an earlier one)
        return found

    lean = latest("lean", "lean", lambda r: (r["model"], r.get("batch"), r.get("seq"), r.get("layers")))
    rows = []
    for (batch,), r in sorted(latest("denoiser", "denoiser_step", lambda r: (r["batch"],)).items()):
        ref = lean.get(("mmdit", batch, None, None))
        ref = ref if ref and "seconds" in ref else None  # a failed lean step (an error record) is no reference
        ratio = r["seconds"] / ref["seconds"] if ref else None
        fraction = r["fraction_of_matmul_rate"]
        rows.append({"name": f"sd3.5-medium-shape denoiser step {r['size']}x{r['size']} (hf_tpu through torch_tpu)",
                     "batch": batch, "measured_s": r["seconds"], "reference_s": ref and ref["seconds"],
                     "floor_s": r["flops"]["total"] / r["matmul_rate"],
                     "target": "within 1.2x of the lean JAX step and at >= 50% of the bf16 matmul rate",
                     "met": None if ratio is None else bool(ratio <= 1.2 and fraction >= 0.5),
                     "ratio_to_reference": ratio, "fraction_of_matmul_rate": fraction, "run": r["run"],
                     "compiles_after_warmup": r["compiles_after_warmup"]})  # fmt: skip
    for _, r in sorted(latest("denoiser", "vae_decode", lambda r: r["size"]).items()):
        rows.append({"name": f"sd3-vae decode {r['size']}x{r['size']} (eager through torch_tpu)", "batch": 1,
                     "measured_s": r["seconds"], "reference_s": None, "floor_s": None, "target": None, "met": None,
                     "run": r["run"], "compiles_after_warmup": r["compiles_after_warmup"]})  # fmt: skip
    trains = latest("train", "train", lambda r: (r["layers"], r["batch"], r["seq"], r["ga"], r["lora"]))
    for (layers, batch, seq, ga, lora), r in sorted(trains.items()):
        what = ", ".join(["LoRA r 16" if lora else "AdamW", "bf16" if r["bf16"] else "bf16 weights, no autocast",
                          *([f"{ga} micro-batches"] if ga > 1 else [])])  # fmt: skip
        ref = None if lora or ga > 1 else lean.get(("llama-train", batch, seq, layers))
        ratio = r["step_s"] / ref["seconds"] if ref else None
        fraction = r["fraction_of_matmul_rate"]
        plain = not lora and ga == 1
        rows.append({"name": f"llama-3.2-1b-shape ({layers} layers) Trainer step, {seq} tokens ({what})",
                     "batch": batch * ga, "measured_s": r["step_s"], "reference_s": ref and ref["seconds"],
                     "floor_s": r["flops"]["total"] / r["matmul_rate"],
                     "target": "within 1.2x of the lean JAX step and at >= 40% of the bf16 matmul rate" if plain
                     else None, "met": None if ratio is None else bool(ratio <= 1.2 and fraction >= 0.4),
                     "ratio_to_reference": ratio, "fraction_of_matmul_rate": fraction, "run": r["run"],
                     "compiles_after_step_2": r["compiles_after_step_2"]})  # fmt: skip
    return rows


def _met(ratio, limit):
    return None if ratio is None else bool(ratio <= limit)


def _round_spread(ref: dict | None) -> float | None:
    """How far megablox gmm's own timings of one point spread in one run: over the rounds after the first (which
    follows the compile) of the tiling the reference took, (slowest - fastest) / fastest; None without rounds.

    "No slower than megablox" is judged within it: where every form is bound by the weights' bytes, two timings of
    the same gmm call differ by 0.1-0.3%, more than some forms differ from it (docs/kernels.md)."""
    if not ref or not ref.get("rounds") or not ref.get("tilings"):
        return None
    tiling = min((t for t, v in ref["tilings"].items() if v), key=lambda t: ref["tilings"][t], default=None)
    rounds = (ref["rounds"].get(tiling) or [])[1:]
    return (max(rounds) - min(rounds)) / min(rounds) if len(rounds) >= 2 else None


def report(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    from hf_tpu.kernels import experts_forms
    from hf_tpu.transformers._cache.writes import KV_ROWS_AFTER_LAYER_BYTES

    records = _load(args.records)
    bw = max((r["bytes_per_second"] for r in records if r.get("part") == "floor" and "bytes_per_second" in r),
             default=819e9)  # fmt: skip
    rows, table_rows = [], []
    # one run per (model, tokens): the latest that measured every form there (a run cut short leaves a point to an
    # earlier one), so that a point's forms are timed alike
    by_run: dict = {}
    for r in records:
        if r.get("part") == "experts" and "form" in r and "error" not in r:
            by_run.setdefault((r["model"], r["tokens"]), {}).setdefault(r["run"], set()).add(r["form"])
    chosen_run = {}
    for point, runs in by_run.items():
        complete = [run for run, forms in runs.items()
                    if {f for f in FORMS if _form_applies(f, point[1], _top_k(point[0]))} <= forms]  # fmt: skip
        chosen_run[point] = max(complete or runs)
    experts = _latest([r for r in records if r.get("part") != "experts" or "form" not in r
                       or chosen_run.get((r["model"], r["tokens"])) == r["run"]], "experts",
                      lambda r: (r["model"], r["tokens"], r["form"]) if "form" in r else None)  # fmt: skip
    points = sorted({(m, t) for m, t, _ in experts}, key=lambda p: ([s[0] for s in EXPERTS_SHAPES].index(p[0]), p[1]))
    for model, tokens in points:
        ref = experts.get((model, tokens, "megablox_gmm_reference"))
        forms = {TABLE_FORMS[f]: experts[(model, tokens, f)]["measured_s"] for f in TABLE_FORMS
                 if (model, tokens, f) in experts}  # fmt: skip
        if not forms:
            continue
        any_row = next(experts[(model, tokens, f)] for f in TABLE_FORMS if (model, tokens, f) in experts)
        routed = any_row["routed_experts"] * 3 * any_row["hidden"] * any_row["intermediate"] * 2
        shape = {k: any_row[k] for k in ("hidden", "intermediate", "experts", "top_k")}
        timing = "back_to_back" if "synced_s" in any_row else "synced"
        table_rows.append({"model": model, **shape, "tokens": tokens, "timing": timing, "seconds": forms})
        table = {"rows": [dict(table_rows[-1])]}
        ref_s = ref["measured_s"] if ref else None
        spread = _round_spread(ref)
        # on a TPU VM hf_tpu chooses among every form (experts_forms.measured_name); without the kernel (what
        # hf-tpu plan lowers, or HF_TPU_MEASURED_EXPERTS=torch) among the forms written in torch
        for label, choice_forms in (("hf_tpu default on a TPU VM", experts_forms.FORMS),
                                    ("torch forms only", experts_forms.DEFAULT_FORMS)):  # fmt: skip
            try:
                form = experts_forms.choose(**{k: shape[k] for k in ("hidden", "intermediate", "experts", "top_k")},
                                            tokens=tokens, forms=choice_forms, table=table)  # fmt: skip
            except ValueError:
                continue
            measured = forms[form]
            ratio = measured / ref_s if ref_s else None
            rows.append({"name": f"experts layer {model} ({label})", "batch": tokens, "form": form,
                         "measured_s": measured, "reference_s": ref_s, "floor_s": routed / bw,
                         "target": "no slower than megablox gmm (best of its tilings)",
                         "met": _met(ratio, 1.0 + (spread or 0.0)), "reference_spread": spread,
                         "ratio_to_reference": ratio, "ratio_to_floor": measured / (routed / bw),
                         "timing": timing, "forms_s": forms})  # fmt: skip
    lean = _latest(records, "lean", lambda r: (r["model"], r["batch"], r["form"]) if "synced_s" in r else None)
    programs = _latest(records, "programs", lambda r: (r["tag"], r["program"]) if "synced_s" in r else None)
    cache_len = PROMPT + NEW_TOKENS
    moe_name = next((m for m, _, _ in lean if m.startswith("qwen3-moe")), "qwen3-moe-8l")
    layers = int(moe_name.split("-")[-1].rstrip("l")) if moe_name[-1] == "l" else QWEN3_MOE["layers"]
    for batch in BATCHES:
        floor = lean_bytes(LLAMA_1B, batch, cache_len, LLAMA_1B["layers"])["all"] / bw
        ref = lean.get(("llama-1b", batch, "dense-mlp"))
        prog = programs.get((f"llama-1b-b{batch}", "decode"))
        if prog or ref:
            measured = prog["back_to_back_s"] if prog else None
            ref_s = ref["back_to_back_s"] if ref else None
            ratio = measured / ref_s if measured and ref_s else None
            rows.append({"name": "llama-3.2-1b-shape decode (hf_tpu program)", "batch": batch, "measured_s": measured,
                         "reference_s": ref_s, "floor_s": floor,
                         "target": "within 1.1x of the lean JAX step (both back to back)",
                         "met": _met(ratio, 1.1), "ratio_to_reference": ratio,
                         "ratio_to_floor": measured / floor if measured else None,
                         "measured_synced_s": prog and prog["synced_s"],
                         "reference_synced_s": ref and ref["synced_s"]})  # fmt: skip
            if prog and "kv_write" in prog:  # (the program leaves its caches to writes after it: HF_TPU_KV_WRITE)
                rows[-1]["kv_write"] = prog["kv_write"]
        for suffix, what in [(f"-attn_{a}", f"one-token attention {a}") for a in REPORTED_ATTENTION] + [
                ("-donated", "KV caches donated")]:  # fmt: skip
            other = programs.get((f"llama-1b-b{batch}{suffix}", "decode"))
            if other and ref:
                ratio = other["back_to_back_s"] / ref["back_to_back_s"]
                rows.append({"name": f"llama-3.2-1b-shape decode (hf_tpu program, {what})",
                             "batch": batch, "measured_s": other["back_to_back_s"],
                             "reference_s": ref["back_to_back_s"],
                             "floor_s": floor, "target": "within 1.1x of the lean JAX step (both back to back)",
                             "met": _met(ratio, 1.1), "ratio_to_reference": ratio,
                             "ratio_to_floor": other["back_to_back_s"] / floor, "measured_synced_s": other["synced_s"],
                             "reference_synced_s": ref["synced_s"]})  # fmt: skip
        pre = programs.get((f"llama-1b-b{batch}", f"prefill-{PROMPT}"))
        if pre:
            rows.append({"name": f"llama-3.2-1b-shape prefill-{PROMPT} (hf_tpu program)", "batch": batch,
                         "measured_s": pre["back_to_back_s"], "reference_s": None, "floor_s": None, "target": None,
                         "met": None, "measured_synced_s": pre["synced_s"]})  # fmt: skip
        floors = {k: v / bw for k, v in lean_bytes(QWEN3_MOE, batch, cache_len, layers).items()}
        target, limit, floor_key = {1: ("<= 2.5x the routed-experts floor", 2.5, "routed"),
                                    64: ("<= 1.3x the every-expert floor", 1.3, "all_experts")}.get(
                                        batch, (None, None, "routed"))  # fmt: skip
        best_lean = min((r for (m, b, _), r in lean.items() if m == moe_name and b == batch),
                        key=lambda r: r["back_to_back_s"], default=None)  # fmt: skip
        for (tag, name), prog in sorted(programs.items()):
            if not tag.startswith("qwen3-moe") or prog["batch"] != batch or name != "decode":
                continue
            measured = prog["back_to_back_s"]
            ratio = measured / floors[floor_key]
            form, donated_caches = prog["form"].removesuffix("+donated"), prog["form"].endswith("+donated")
            form, kv_after = form.removesuffix("+kv_after"), form.endswith("+kv_after") or "kv_write" in prog
            # hf_tpu's choice: its experts form for the batch, its rows written after the program where auto does so
            per_layer = (prog.get("facts") or {}).get("kv_cache_bytes", 0) / layers
            default = form == DEFAULT_DECODE_PROGRAM.get(batch) and not donated_caches and kv_after == (
                per_layer >= KV_ROWS_AFTER_LAYER_BYTES)  # fmt: skip
            experts, _, attention = form.partition("+attn_")
            what = f"experts {experts}" + (f", one-token attention {attention}" if attention else "") + (
                ", KV caches donated" if donated_caches else "") + (
                ", KV rows written after the program" if kv_after else "")  # fmt: skip
            rows.append({"name": f"qwen3-30b-a3b-shape {layers} layers decode (hf_tpu program, {what}"
                                 f"{', the default choice' if default else ''})", "batch": batch,
                         "measured_s": measured, "reference_s": best_lean and best_lean["back_to_back_s"],
                         "reference_form": best_lean and best_lean["form"], "floor_s": floors[floor_key],
                         "floor_kind": floor_key, "target": target, "met": _met(ratio, limit) if limit else None,
                         "ratio_to_floor": ratio, "measured_synced_s": prog["synced_s"]})  # fmt: skip
        for (m, b, form), r in sorted(lean.items()):
            if m != moe_name or b != batch:
                continue
            ratio = r["back_to_back_s"] / floors[floor_key]
            rows.append({"name": f"qwen3-30b-a3b-shape {layers} layers decode (lean JAX step, experts {form})",
                         "batch": batch, "measured_s": r["back_to_back_s"], "reference_s": None,
                         "floor_s": floors[floor_key], "floor_kind": floor_key, "target": target,
                         "met": _met(ratio, limit) if limit else None, "ratio_to_floor": ratio,
                         "measured_synced_s": r["synced_s"]})  # fmt: skip
    rows += torch_tpu_rows(_load(args.torch_tpu_records))
    result = {"device": "TPU v5 lite (one chip), jax 0.10.2", "source": "scripts/chip_bench.py report",
              "records": [str(p) for p in args.records],
              "torch_tpu_records": [str(p) for p in args.torch_tpu_records], "bytes_per_second": bw,
              "timing": "measured_s: back to back (a step's result not waited for before the next is dispatched); "
                        "*_synced_s: each call waited for. Experts rows with timing 'synced' come from the first run.",
              "rows": rows}  # fmt: skip
    if args.rows:
        path = Path(args.rows)
        if path.exists():  # what an earlier version of this file held stays, under "earlier"
            old = json.loads(path.read_text())
            result["earlier"] = old.get("earlier", old) if "rows" in old else old
        path.write_text(json.dumps(result, indent=1) + "\n")
    if args.table:
        Path(args.table).write_text(json.dumps({"device": "TPU v5e (one chip)", "source": "scripts/chip_bench.py",
                                                "rows": table_rows}, indent=1) + "\n")  # fmt: skip
    print(markdown(rows))
    return 0


def _ms(v):
    return "—" if v is None else f"{v * 1e3:.2f} ms"


def markdown(rows: list[dict]) -> str:
    lines = ["| row | batch / tokens | measured | reference | floor | target |", "|---|---|---|---|---|---|"]
    for r in rows:
        verdict = "" if r["target"] is None else (" met" if r["met"] else (" **missed**" if r["met"] is False else ""))
        form = f" [{r['form']}]" if "form" in r else ""
        lines.append(f"| {r['name']}{form} | {r['batch']} | {_ms(r['measured_s'])} | {_ms(r.get('reference_s'))} | "
                     f"{_ms(r.get('floor_s'))} | {r['target'] or '—'}{verdict} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    low = sub.add_parser("lower", help="lower hf_tpu's programs (needs torch-tpu; no chip)")
    low.add_argument("folder")
    low.add_argument("--target", default="v5e-1")
    low.add_argument("--moe-layers", type=int, default=QWEN3_MOE["layers"])
    low.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    low.add_argument("--again", action="store_true", help="lower again what is there already")
    go = sub.add_parser("run", help="every part on this machine's chip, each in a process with a timeout (jax)")
    go.add_argument("folder")
    go.add_argument("--out", default=os.environ.get("OUT", "."))
    go.add_argument("--parts", nargs="+", default=["floor", "experts", "lean", "programs"], choices=list(TIMEOUTS))
    go.add_argument("--quick", action="store_true", help="tiny shapes (a check of the script on a CPU)")
    every = sub.add_parser("all", help="lower, run on this machine's chip and report (needs torch-tpu and jax)")
    every.add_argument("folder")
    every.add_argument("--target", default="v5e-1")
    rep = sub.add_parser("report", help="rows, hf_tpu's choice table and a markdown table from records")
    rep.add_argument("records", nargs="+", help="records.jsonl files, later ones replacing earlier measurements")
    rep.add_argument("--rows", help="write the rows here (docs/chip_v5e.json)")
    rep.add_argument("--torch-tpu-records", nargs="*", default=[],
                     help="scripts/chip_torch_tpu.py's records (docs/chip_v5e_torch_tpu.jsonl): its images and "
                     "training rows")  # fmt: skip
    rep.add_argument("--table", help="write hf_tpu's experts choice table here (hf_tpu/kernels/experts_v5e.json)")
    one = sub.add_parser("part", help=argparse.SUPPRESS)
    one.add_argument("part", choices=list(TIMEOUTS))
    one.add_argument("folder")
    one.add_argument("--out", required=True)
    one.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "lower":
        return lower(args)
    if args.command == "run":
        return run(args)
    if args.command == "report":
        return report(args)
    if args.command == "all":
        folder = Path(args.folder)
        lower(argparse.Namespace(folder=str(folder), target=args.target, moe_layers=QWEN3_MOE["layers"],
                                 batches=BATCHES, again=False))  # fmt: skip
        out = folder / "measured"
        run(argparse.Namespace(folder=str(folder), out=str(out), parts=list(TIMEOUTS), quick=False))
        return report(argparse.Namespace(records=[str(out / "records.jsonl")], rows=str(folder / "rows.json"),
                                         table=str(folder / "experts_table.json")))  # fmt: skip
    if args.command == "part":
        out = Path(args.out)
        if args.part in ("floor", "experts"):
            {"floor": part_floor, "experts": part_experts}[args.part](out, args.quick)
        else:
            PARTS[args.part](out, Path(args.folder), args.quick)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
