"""hf_tpu on a TPU chip with torch_tpu itself: its runtime, its compiled graphs, its JAX bridge, its eager ops.

``scripts/chip_bench.py`` runs the programs hf_tpu lowers through JAX's TPU client; this script runs hf_tpu as a
user does, ``model.generate`` on a ``tpu`` device of torch-tpu 0.2.0, and times what only torch_tpu's runtime
decides: how long an eager op or a read-back takes, whether ``index_copy_`` updates a buffer in place, what the
Hub kernel's forms cost inside torch_tpu's compiled graphs, the whole decode loop of a Llama-3.2-1B shape, its
prefill against the chip's matmul rate (``prefill``), ``hf-tpu serve`` of it under concurrent streams over a unix
socket (``serve``; the lent chip opens no TCP socket), an SD3.5-medium-shaped pipeline's denoiser step, VAE decode and
image (``denoiser``) and ``transformers.Trainer`` steps of the 1B shape (``train``), each against the chip's matmul
rate and a lean JAX step of the same shape (``lean`` with ``MODELS=mmdit+train``)::

    python scripts/chip_torch_tpu.py run --out results/            # on a TPU VM with hf-tpu[tpu] installed
    python scripts/chip_torch_tpu.py run --out results/ --stages experts llama_decode

Each stage runs in a process of its own with its own timeout and appends its records to ``results.jsonl`` as they
come (``name[:seconds[:ENV=V,ENV=V]]`` narrows a stage: ``experts:200:SHAPE=mixtral,TOKENS=1_8_512``).

This project's lent chip machine has JAX, libtpu 0.0.42 and no torch: ``pack`` makes, from a local venv with
torch-tpu 0.2.0 and libtpu 0.0.52, the folders that travel there (each under the tool's 64 MiB per call with the
working tree: torch_tpu for torch 2.13 with its small dependencies; libtpu 0.0.52's wheel in three parts, the kernels
wheel beside the first; the extras the chip tier, the self-test and transformers need, EXTRA_WHEELS, with transformers'
wheel), and
``install`` (on the chip, once per warm machine, one folder per call) puts them under /tmp/hf_tpu_chip with torch
2.13.0 from the machine's own wheels::

    python scripts/chip_torch_tpu.py pack .chip_carry --venv .venv-tpu     # here: .chip_carry/{tt,lt1,lt2,lt3,ex}
    python scripts/chip_torch_tpu.py install .chip_carry/ex                 # on the chip, one call each, in order:
    python scripts/chip_torch_tpu.py install .chip_carry/lt1               # ex and lt1 before tt (transformers 5.25
    python scripts/chip_torch_tpu.py install .chip_carry/tt                # needs huggingface_hub 2.4, which the
    python scripts/chip_torch_tpu.py install .chip_carry/lt2               # machine's index lacks, and kernels 0.19)
    python scripts/chip_torch_tpu.py install .chip_carry/lt3
    python scripts/chip_torch_tpu.py run --out $OUT                        # then as on a TPU VM

Figures from a run: docs/chip_v5e_torch_tpu.jsonl and docs/planning.md ("Measured with torch_tpu itself").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_BUILD = ROOT / "hf_tpu/kernels/hub/ragged-dot-tpu/build/torch-tpu"
CHIP_HOME = Path("/tmp/hf_tpu_chip")  # on the lent chip: site (torch, torch_tpu), libtpu, transformers
TORCH_VERSION = "2.13.0"
TORCH_TAG = "2_13_0"  # torch_tpu ships a build per torch version; only torch 2.13's travels
OTHER_TAGS = ("2_11_0", "2_12_0", "2_14_0", "2_15_0")
SMALL_WHEELS = ("frozendict", "immutabledict", "portpicker", "pyzmq")
LIBTPU_PARTS = 3  # libtpu 0.0.52's wheel is 137 MB: three calls of about 46 MB
# What the chip tier and `hf-tpu selftest` need beyond transformers (device_map, training, LoRA, diffusers, torchao and
# compressed-tensors, the server and its openai client) and the lent machine's own index may lack: the versions
# installed in the packing venv travel as wheels in dest/ex and install without dependencies (the machine's own
# packages come first on its PYTHONPATH, so a wheel it already has is shadowed, not replaced).
EXTRA_WHEELS = ("accelerate", "peft", "diffusers", "torchao", "compressed-tensors", "fastapi", "starlette",
                "annotated-doc", "annotated-types", "pydantic", "pydantic-core", "typing-inspection",
                "opentelemetry-api", "uvicorn", "click", "h11", "anyio", "sniffio", "openai", "httpx2", "httpcore2",
                "idna", "truststore", "jiter", "prometheus-client", "psutil", "loguru", "pillow", "importlib-metadata",
                "zipp", "rich", "pygments", "markdown-it-py", "mdurl", "typing-extensions", "requests", "certifi",
                "charset-normalizer", "urllib3", "typer", "shellingham", "filelock",
                # transformers 5.25 needs huggingface_hub 2.4, which the lent machine's index lacks (it has 2.0), and
                # a tokenizers that admits it (the index's 0.23.2 wants huggingface_hub < 2.0); the tt folder's
                # transformers install finds these in the ex folder's wheels (install ex first)
                "huggingface-hub", "hf-xet", "tokenizers")  # fmt: skip
DEFAULT_STAGES = ("basics:90", "dispatch:120", "kv_write:120", "jaxop:150", "generate:180",
                  "generate:180:CASE=moe_kernel", "experts:200:SHAPE=qwen3,TOKENS=1_8_512",
                  "experts:200:SHAPE=mixtral,TOKENS=1_8_512", "llama_decode:470")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Records and timing (inside a stage process)
# ---------------------------------------------------------------------------------------------------------------

_OUT: Path | None = None
_STAGE = ""


def rec(**fields) -> None:
    """Append one record to ``results.jsonl`` (and print it)."""
    fields = {"stage": _STAGE, **fields, "t": time.time()}
    line = json.dumps(fields, default=str)
    print(line, flush=True)
    if _OUT is not None:
        with open(_OUT / "results.jsonl", "a") as f:
            f.write(line + "\n")


def sync() -> None:
    import torch

    torch.accelerator.synchronize()  # torch.tpu.synchronize is internal to torch_tpu (it says so when called)


def per_call(fn, n: int) -> float:
    """Seconds per call of ``fn``, ``n`` calls dispatched back to back after one warm call."""
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - start) / n


def _numbers(text: str) -> list[int]:
    return [int(t) for t in text.replace("_", " ").split()]


def _kernel():
    """The ragged-dot Hub kernel shipped with hf_tpu, imported from its build folder (no ``kernels`` needed)."""
    if str(KERNEL_BUILD) not in sys.path:
        sys.path.insert(0, str(KERNEL_BUILD))
    import ragged_dot_tpu

    return ragged_dot_tpu


# ---------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------


def stage_basics() -> None:
    """torch_tpu loads, sees the chip, and a product on it equals the CPU's."""
    import torch
    import torch_tpu  # noqa: F401

    rec(step="loaded", torch=torch.__version__, devices=torch.accelerator.device_count())
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    got = (a.to("tpu") @ b.to("tpu")).cpu()
    want = a @ b
    rec(step="matmul", rel_err=float((got - want).abs().max() / want.abs().max()))


def stage_dispatch() -> None:
    """A small compiled step: synced each call vs back to back, the host's time to enqueue a call, and a read-back
    (``.item()``) every 1, 8 or 64 steps; one eager op's cost."""
    import torch
    import torch_tpu  # noqa: F401

    torch.set_grad_enabled(False)
    weights = [torch.randn(2048, 2048, dtype=torch.bfloat16, device="tpu") for _ in range(16)]

    def step(x):
        for w in weights:
            x = torch.tanh(x @ w)
        return x

    f = torch.compile(step, backend="tpu", fullgraph=True, dynamic=False)
    x = torch.randn(8, 2048, dtype=torch.bfloat16, device="tpu")
    f(x)
    sync()

    def synced():
        f(x)
        sync()

    rec(step="compiled_step", synced_s=per_call(synced, 100), back_to_back_s=per_call(lambda: f(x), 100))
    start = time.perf_counter()
    y = x
    for _ in range(100):
        y = f(y)
    enqueue = (time.perf_counter() - start) / 100
    sync()
    rec(step="enqueue", host_s_per_call=enqueue, total_s_per_call=(time.perf_counter() - start) / 100)

    def chain(every):
        z = x
        start = time.perf_counter()
        for i in range(64):
            z = f(z)
            if (i + 1) % every == 0:
                z.sum().item()
        sync()
        return (time.perf_counter() - start) / 64

    rec(step="read_back", every_1_s=chain(1), every_8_s=chain(8), every_64_s=chain(64))
    tiny = torch.zeros(8, device="tpu")
    rec(step="eager_op", add_s=per_call(lambda: tiny.add_(1), 200))


def stage_kv_write() -> None:
    """``index_copy_`` on a cache of 9 GiB (a copy would not fit beside it on a 15.75 GiB chip), then 32 one-slot
    writes into batch-64 Llama-3.2-1B-shaped caches, eager (one op each) and as one compiled graph."""
    import torch
    import torch_tpu  # noqa: F401

    torch.set_grad_enabled(False)
    gib = float(os.environ.get("GIB", "9"))
    slots = int(gib * 2**30 / (64 * 8 * 64 * 2))
    cache = torch.zeros(64, 8, slots, 64, dtype=torch.bfloat16, device="tpu")
    row = torch.ones(64, 8, 1, 64, dtype=torch.bfloat16, device="tpu")
    try:
        for slot in (5, 10, 11):
            cache.index_copy_(2, torch.tensor([slot], device="tpu"), row)
        sync()
        rec(step="index_copy_in_place", cache_gib=gib, ok=True)
    except Exception as exc:  # noqa: BLE001 - the record says what happened
        rec(step="index_copy_in_place", cache_gib=gib, ok=False, error=repr(exc)[:1500])
    del cache
    caches = [torch.zeros(64, 8, 640, 64, dtype=torch.bfloat16, device="tpu") for _ in range(32)]
    rows = [torch.full((64, 8, 1, 64), float(i + 1), dtype=torch.bfloat16, device="tpu") for i in range(32)]
    pos = torch.tensor([5], device="tpu")

    def eager():
        for c, r in zip(caches, rows, strict=True):
            c.index_copy_(2, pos, r)

    def write_all(cs, rs, p):
        for c, r in zip(cs, rs, strict=True):
            c.index_copy_(2, p, r)

    compiled = torch.compile(write_all, backend="tpu", fullgraph=True, dynamic=False)
    rec(step="write_32_rows", eager_s=per_call(eager, 20),
        compiled_s=per_call(lambda: compiled(caches, rows, pos), 20))  # fmt: skip
    compiled(caches, rows, torch.tensor([7], device="tpu"))
    got = caches[3].index_select(2, torch.tensor([6, 7], device="tpu"))[0, 0, :, 0].float().cpu().tolist()
    rec(step="compiled_write_value", slots_6_7=got, want=[0.0, 4.0])


def _reference_ragged_dot(lhs, rhs, sizes):
    import torch

    out = torch.zeros(lhs.shape[0], rhs.shape[1])
    start = 0
    for group, n in enumerate(sizes.tolist()):
        out[start : start + n] = lhs[start : start + n].float() @ rhs[group].float().T
        start += n
    return out


def stage_jaxop() -> None:
    """The Hub kernel through torch_tpu's JAX bridge (``torch.tpu.pallas.jax_op``): eager and inside a compiled
    graph, each implementation against a CPU reference."""
    import torch
    import torch_tpu  # noqa: F401

    kernel = _kernel()
    torch.manual_seed(0)
    lhs = torch.randn(64, 256, dtype=torch.bfloat16)
    rhs = torch.randn(8, 512, 256, dtype=torch.bfloat16)
    sizes = torch.tensor([10, 0, 7, 20, 3, 0, 16, 8], dtype=torch.int32)
    want = _reference_ragged_dot(lhs, rhs, sizes)
    scale = float(want.abs().max())
    args = (lhs.to("tpu"), rhs.to("tpu"), sizes.to("tpu"))
    for impl in ("pallas", "pallas_decode", "megablox"):
        for where in ("eager", "graph"):
            try:

                def call(a, b, c, impl=impl):
                    return kernel.ragged_dot(a, b, c, rhs_transposed=True, implementation=impl)

                fn = call if where == "eager" else torch.compile(call, backend="tpu", fullgraph=True, dynamic=False)
                got = fn(*args).cpu().float()
                rec(step=where, impl=impl, rel_err=float((got - want).abs().max()) / scale,
                    per_call_s=per_call(lambda fn=fn: fn(*args), 50))  # fmt: skip
            except Exception as exc:  # noqa: BLE001
                rec(step=where, impl=impl, error=repr(exc)[:1500])


def _tiny_model(kind: str, path: str) -> str:
    """hf_tpu.testing's tiny Llama or Qwen3-MoE at lane-friendly sizes (the Pallas kernels tile by 128), saved."""
    import torch

    from hf_tpu.testing import tiny_model

    sizes = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, head_dim=64, max_position_embeddings=512)
    if kind != "llama":
        sizes.update(moe_intermediate_size=256)
    model = tiny_model("llama" if kind == "llama" else "qwen3_moe", **sizes)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # sharper logits: greedy tokens far from ties
    model.save_pretrained(path)
    return path


def stage_generate() -> None:
    """hf_tpu's ``generate`` on torch_tpu (tiny random models, float32 at torch_tpu's 'highest' matmul precision):
    the tokens against the CPU's, batch 1 and 4, 32 new tokens. ``CASE``: ``llama``, ``moe`` (hf_tpu's default
    experts choice) or ``moe_kernel`` (the Hub kernel's ``KERNEL_IMPL`` form in every graph)."""
    import torch

    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    import hf_tpu

    rec(step="runtime", mode=hf_tpu.runtime.detect().mode)
    torch.set_float32_matmul_precision("highest")
    hf_tpu.enable("generation")
    from transformers import AutoModelForCausalLM

    case = os.environ.get("CASE", "llama")
    kind = "llama" if case == "llama" else "moe"
    path = _tiny_model(kind, f"/tmp/hf_tpu_chip_tiny_{kind}")
    kwargs = {}
    if case == "moe_kernel":
        from hf_tpu.kernels.registry import register_experts, registered_experts

        impl = os.environ.get("KERNEL_IMPL", "pallas_decode")
        if "chip_kernel" not in registered_experts():
            register_experts("chip_kernel", _kernel().make_experts_forward(impl))
        kwargs["experts_implementation"] = "chip_kernel"
    torch.manual_seed(1)
    for batch in (1, 4):
        ids = torch.randint(3, 1000, (batch, 12))
        mask = torch.ones_like(ids)
        cpu = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            want = cpu.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).to("tpu")
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False).cpu()
        rec(step="generate", case=case, batch=batch, equal=bool(got.shape == want.shape and (got == want).all()),
            first_s=first, second_s=time.perf_counter() - start,
            experts=getattr(model.config, "_experts_implementation", None),
            kv_write=os.environ.get("HF_TPU_KV_WRITE", "auto"))  # fmt: skip


def _errors(got, want) -> dict:
    """``max|got - want| / max|want|`` (scaled) and the largest elementwise relative error, in float64."""
    import torch

    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    diff = (got - want).abs()
    big = want.abs() > 1e-30
    rel = float((diff[big] / want.abs()[big]).max()) if bool(big.any()) else 0.0
    return {"scaled_err": float(diff.max() / want.abs().max().clamp_min(1e-300)), "max_rel_err": rel}


def stage_numerics() -> None:
    """What a chip computes that a test can see, each against float64 (and the CPU's float32 where it says so):
    float32 matmuls at each precision and contraction length (and whether 'medium' is exactly one bfloat16 pass),
    linear/bmm/conv/sdpa at each precision, elementwise functions eager and compiled, reductions, bfloat16
    accumulation, denormals, integers, ties, and the RNG. Every group is recorded on its own (a failure too).
    With ``HF_TPU_SIMULATE=1`` the same code measures the simulated device (docs/simulator.md sets both side by
    side)."""
    import torch

    if os.environ.get("HF_TPU_SIMULATE") == "1":
        import hf_tpu.sim

        hf_tpu.sim.enable(emulate_precision=True)
    else:
        import torch_tpu  # noqa: F401

    torch.set_grad_enabled(False)
    g = torch.Generator().manual_seed(0)
    rec(step="default_precision", precision=torch.get_float32_matmul_precision())

    def group(name, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - recorded, the next group runs
            rec(step=name, error=repr(exc)[:600])

    def matmuls():
        for precision in ("medium", "high", "highest"):
            torch.set_float32_matmul_precision(precision)
            for k in (32, 256, 1024, 4096):
                a, b = torch.randn(256, k, generator=g), torch.randn(k, 256, generator=g)
                got = (a.to("tpu") @ b.to("tpu")).cpu()
                one_pass = a.bfloat16().double() @ b.bfloat16().double()
                rec(step="matmul", precision=precision, k=k, **_errors(got, a.double() @ b.double()),
                    vs_one_bf16_pass=_errors(got, one_pass)["scaled_err"],
                    cpu_f32=_errors(a @ b, a.double() @ b.double())["scaled_err"])  # fmt: skip
        torch.set_float32_matmul_precision("medium")

    def layers():
        x = torch.randn(4, 64, 128, generator=g)
        w, bias = torch.randn(96, 128, generator=g), torch.randn(96, generator=g)
        img, ker = torch.randn(2, 8, 16, 16, generator=g), torch.randn(12, 8, 3, 3, generator=g)
        q, k, v = (torch.randn(2, 4, 32, 64, generator=g) for _ in range(3))
        cases = {
            "linear": (lambda d: torch.nn.functional.linear(d(x), d(w), d(bias)),),
            "bmm": (lambda d: d(x) @ d(x).transpose(1, 2),),
            "conv2d": (lambda d: torch.nn.functional.conv2d(d(img), d(ker), padding=1),),
            "sdpa_causal": (lambda d: torch.nn.functional.scaled_dot_product_attention(d(q), d(k), d(v), is_causal=True),),
        }  # fmt: skip
        for precision in ("medium", "high", "highest"):
            torch.set_float32_matmul_precision(precision)
            for name, (fn,) in cases.items():
                want = fn(lambda t: t.double())
                got = fn(lambda t: t.to("tpu"))
                rec(step="layer", op=name, precision=precision, **_errors(got, want),
                    cpu_f32=_errors(fn(lambda t: t), want)["scaled_err"])  # fmt: skip
        torch.set_float32_matmul_precision("medium")

    def compiled_precision():
        # Is the precision read when a graph compiles (and kept by a later call at another setting) or when it runs?
        a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
        want = a.double() @ b.double()
        torch._dynamo.reset()
        f = torch.compile(lambda x, y: x @ y, backend="tpu", fullgraph=True, dynamic=False)
        ad, bd = a.to("tpu"), b.to("tpu")
        errs = {}
        for precision in ("medium", "highest", "medium"):
            torch.set_float32_matmul_precision(precision)
            errs.setdefault(precision, []).append(_errors(f(ad, bd), want)["scaled_err"])
        torch._dynamo.reset()
        torch.set_float32_matmul_precision("highest")
        fresh = _errors(torch.compile(lambda x, y: x @ y, backend="tpu", fullgraph=True)(ad, bd), want)["scaled_err"]
        # a shape no graph of this process has had: is the precision read when a new program compiles?
        c, d = torch.randn(192, 320, generator=g), torch.randn(320, 160, generator=g)
        torch._dynamo.reset()
        new_shape = torch.compile(lambda x, y: x @ y, backend="tpu", fullgraph=True)(c.to("tpu"), d.to("tpu"))
        new_shape_err = _errors(new_shape, c.double() @ d.double())["scaled_err"]
        with torch.tpu.precision(torch.tpu.Precision.HIGHEST):
            scoped = _errors(f(ad, bd), want)["scaled_err"]
        torch.set_float32_matmul_precision("medium")
        rec(step="compiled_precision", calls=errs, compiled_at_highest=fresh, new_shape_at_highest=new_shape_err,
            first_graph_under_tpu_precision_highest=scoped)  # fmt: skip

    def elementwise():
        x = torch.randn(1 << 16, generator=g) * 4
        pos = x.abs() + 0.1
        ops = {
            "exp": (torch.exp, x), "log": (torch.log, pos), "tanh": (torch.tanh, x), "erf": (torch.erf, x),
            "sigmoid": (torch.sigmoid, x), "rsqrt": (torch.rsqrt, pos), "sqrt": (torch.sqrt, pos),
            "sin": (torch.sin, x), "gelu": (torch.nn.functional.gelu, x),
            "gelu_tanh": (lambda t: torch.nn.functional.gelu(t, approximate="tanh"), x),
            "silu": (torch.nn.functional.silu, x), "softmax": (lambda t: torch.softmax(t.view(64, -1), -1), x),
            "log_softmax": (lambda t: torch.log_softmax(t.view(64, -1), -1), x), "pow_2.5": (lambda t: t**2.5, pos),
            "div": (lambda t: t / 3.0, x),
        }  # fmt: skip
        for name, (fn, inp) in ops.items():
            want = fn(inp.double())
            eager = fn(inp.to("tpu"))
            torch._dynamo.reset()  # one graph per op (the same wrapper would hit the recompile limit)
            compiled = torch.compile(fn, backend="tpu", fullgraph=True)(inp.to("tpu"))
            rec(step="elementwise", op=name, eager=_errors(eager, want), compiled=_errors(compiled, want),
                cpu_f32=_errors(fn(inp), want), eager_equals_cpu=bool(torch.equal(eager.cpu(), fn(inp))))  # fmt: skip

    def reductions():
        x = torch.randn(1 << 20, generator=g)
        m = torch.randn(1024, 1024, generator=g)
        for name, fn in {"sum": lambda t: t.sum(), "mean": lambda t: t.mean(), "var": lambda t: t.var(),
                         "cumsum_last": lambda t: t.cumsum(0)[-1], "norm": lambda t: t.norm()}.items():  # fmt: skip
            want = fn(x.double())
            rec(step="reduction", op=name, tpu=_errors(fn(x.to("tpu")), want), cpu_f32=_errors(fn(x), want))
        want = m.double().sum(1)
        rec(step="reduction", op="row_sum_1024", tpu=_errors(m.to("tpu").sum(1), want), cpu_f32=_errors(m.sum(1), want))

    def bfloat16():
        a, b = torch.randn(64, 4096, generator=g).bfloat16(), torch.randn(4096, 64, generator=g).bfloat16()
        got, cpu = (a.to("tpu") @ b.to("tpu")).cpu(), a @ b
        want = a.double() @ b.double()
        rec(step="bf16_matmul", tpu=_errors(got, want), cpu=_errors(cpu, want),
            equal_to_cpu_fraction=float((got == cpu).float().mean()))  # fmt: skip
        s = torch.randn(4096, generator=g).bfloat16()
        rec(step="bf16_sum", tpu=float(s.to("tpu").sum().float()), cpu=float(s.sum().float()),
            f64=float(s.double().sum()))  # fmt: skip
        x = torch.randn(1000, generator=g)
        rec(step="f32_to_bf16_rounding_equal_cpu", equal=bool(torch.equal(x.to("tpu").bfloat16().cpu(), x.bfloat16())))

    def special():
        tiny = torch.tensor([1e-38, 1e-40, 1e-45, -1e-40], dtype=torch.float32)
        rec(step="denormals", copied=tiny.to("tpu").cpu().tolist(), times_one=(tiny.to("tpu") * 1.0).cpu().tolist(),
            cpu=(tiny * 1.0).tolist(), one_over_1e38=(1.0 / tiny.to("tpu")).cpu().tolist())  # fmt: skip
        z = torch.tensor([1.0, -1.0, 0.0])
        rec(step="div_by_zero", tpu=(z.to("tpu") / 0.0).cpu().tolist(), cpu=(z / 0.0).tolist())
        n = torch.tensor([1.0, float("nan"), 3.0])
        rec(step="nan", max_tpu=float(n.to("tpu").max()), argmax_tpu=int(n.to("tpu").argmax()),
            max_cpu=float(n.max()), argmax_cpu=int(n.argmax()))  # fmt: skip
        t = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
        rec(step="ties", argmax_tpu=int(t.to("tpu").argmax()), argmax_cpu=int(t.argmax()),
            topk_tpu=t.to("tpu").topk(3).indices.cpu().tolist(), topk_cpu=t.topk(3).indices.tolist(),
            sort_stable_tpu=t.to("tpu").sort(stable=True, descending=True).indices.cpu().tolist(),
            sort_stable_cpu=t.sort(stable=True, descending=True).indices.tolist())  # fmt: skip
        temp = torch.tensor([1e-38, 1e-30, 1e-10], dtype=torch.float32)
        logits = torch.randn(3, 16, generator=g)
        scaled = (logits.to("tpu") / temp.to("tpu")[:, None]).cpu()
        rec(step="logits_over_tiny_temperature", tpu_finite=torch.isfinite(scaled).all(1).tolist(),
            cpu_finite=torch.isfinite(logits / temp[:, None]).all(1).tolist())  # fmt: skip

    def integers():
        i32 = torch.tensor([2**31 - 1, -(2**31)], dtype=torch.int32)
        big = torch.tensor([2**40 + 1, -(2**40) - 3, 2**62], dtype=torch.int64)
        q = torch.tensor([-7, 7, -7], dtype=torch.int64)
        d = torch.tensor([2, -2, -2], dtype=torch.int64)
        rec(step="integers", int32_wrap_tpu=(i32.to("tpu") + 1).cpu().tolist(), int32_wrap_cpu=(i32 + 1).tolist(),
            int64_roundtrip=big.to("tpu").cpu().tolist(), int64_add_tpu=(big.to("tpu") + 1).cpu().tolist(),
            int64_add_cpu=(big + 1).tolist(), floordiv_tpu=(q.to("tpu") // d.to("tpu")).cpu().tolist(),
            floordiv_cpu=(q // d).tolist(), remainder_tpu=torch.remainder(q.to("tpu"), d.to("tpu")).cpu().tolist(),
            remainder_cpu=torch.remainder(q, d).tolist())  # fmt: skip
        try:
            f64 = torch.tensor([1.0 + 2**-40], dtype=torch.float64).to("tpu")
            rec(step="float64", dtype=str(f64.dtype), exact=bool(float(f64.cpu()) == 1.0 + 2**-40),
                add=float((f64 + f64).cpu()))  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            rec(step="float64", error=repr(exc)[:400])

    def rng():
        torch.manual_seed(0)
        cpu = torch.randn(6)
        torch.manual_seed(0)
        tpu = torch.randn(6, device="tpu").cpu()
        torch.manual_seed(0)
        tpu2 = torch.randn(6, device="tpu").cpu()
        gen = torch.Generator("tpu").manual_seed(3)
        a = torch.rand(4, device="tpu", generator=gen).cpu()
        gen.manual_seed(3)
        b = torch.rand(4, device="tpu", generator=gen).cpu()
        torch.manual_seed(0)
        m = torch.multinomial(torch.ones(4, 50, device="tpu"), 1).cpu().flatten().tolist()
        rec(step="rng", randn_equals_cpu=bool(torch.equal(cpu, tpu)), reseeded_equal=bool(torch.equal(tpu, tpu2)),
            generator_reseeded_equal=bool(torch.equal(a, b)), tpu_randn=tpu.tolist(), cpu_randn=cpu.tolist(),
            multinomial=m)  # fmt: skip

    for name, fn in (("matmul", matmuls), ("layer", layers), ("compiled_precision", compiled_precision),
                     ("elementwise", elementwise),
                     ("reduction", reductions), ("bf16", bfloat16), ("special", special), ("integers", integers),
                     ("rng", rng)):  # fmt: skip
        group(name, fn)


def stage_selftest() -> None:
    """``hf-tpu selftest`` (every check, in this process) as a TPU VM user runs it; the report in out/."""
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
    from hf_tpu.cli.main import main as hf_tpu_main

    code = hf_tpu_main(["selftest", "--report", str(_OUT / "selftest.json")])
    report = json.loads((_OUT / "selftest.json").read_text())
    for check in report.get("checks", []):
        rec(step="check", name=check["name"], status=check["status"], error=check.get("error"),
            reason=check.get("reason"), seconds=check.get("seconds"),
            figures={k: v for k, v in (check.get("figures") or {}).items() if "err" in k or k in ("precision", "tolerance", "default")})  # fmt: skip
    rec(step="selftest", exit=code)


def stage_moe_diag() -> None:
    """The tiny Qwen3-MoE's batch-4 tokens against the CPU's: the first differing step per row, both sides' top-2
    margins there, and each experts form forced (``scripts/chip_moe_diag.py``)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    if os.environ.get("HF_TPU_SIMULATE") != "1":
        # torch_tpu loaded first, as its autoload does on a TPU VM (run 18: without it ``.to("tpu")`` found no such
        # device in this stage)
        import torch  # noqa: F401
        import torch_tpu  # noqa: F401
    import chip_moe_diag

    chip_moe_diag.stage_moe_diag(rec)


def stage_tier() -> None:
    """The chip tier of the suite (``pytest -m chip tests/chip``) in this process's child, its rows in out/."""
    # the lent machine's python has pytest but not pytest-timeout: each child process of a case has its own timeout
    env = {"HF_TPU_CHIP_SUBPROCESS_S": "150", **os.environ, "HF_TPU_CHIP_RECORD": str(_OUT / "chip_tier.json")}
    cmd = [sys.executable, "-m", "pytest", "-m", "chip", "tests/chip", "-p", "no:xdist", "-p", "no:cacheprovider",
           "-q", "-rs", *os.environ.get("TIER_ARGS", "").split()]  # fmt: skip
    code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    rec(step="tier", exit=code)


EXPERTS_SHAPES = {
    "qwen3": dict(hidden=2048, intermediate=768, experts=128, top_k=8),
    "mixtral": dict(hidden=4096, intermediate=14336, experts=8, top_k=2),
}


def stage_experts() -> None:
    """One experts layer (transformers' module, random bf16 weights) in each of hf_tpu's forms, each compiled by
    torch_tpu as its own graph, back to back; outputs against the first form's."""
    import torch
    import torch_tpu  # noqa: F401
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from hf_tpu.kernels import experts_forms

    kernel = _kernel()
    experts_forms._kernel_forward = lambda form: kernel.make_experts_forward(experts_forms.KERNEL_FORMS[form])
    torch.set_grad_enabled(False)
    name = os.environ.get("SHAPE", "qwen3")
    shape = EXPERTS_SHAPES[name]
    if name == "qwen3":
        config = Qwen3MoeConfig(hidden_size=shape["hidden"], moe_intermediate_size=shape["intermediate"],
                                num_experts=shape["experts"], num_experts_per_tok=shape["top_k"])  # fmt: skip
        cls = Qwen3MoeExperts
    else:
        config = MixtralConfig(hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                               num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"])  # fmt: skip
        cls = MixtralExperts
    with torch.device("meta"):
        module = cls(config)
    module = module.to_empty(device="tpu").to(torch.bfloat16).requires_grad_(False)
    for p in module.parameters():
        p.copy_(torch.randn(p.shape, dtype=torch.bfloat16, device="tpu") * 0.02)
    generator = torch.Generator().manual_seed(0)
    forms = os.environ.get("FORMS", "slots dense grouped_mm kernel_decode kernel megablox").replace("+", " ").split()
    for tokens in _numbers(os.environ.get("TOKENS", "1 8 512")):
        x = (torch.randn(tokens, shape["hidden"], generator=generator) * 0.5).to(torch.bfloat16).to("tpu")
        index = torch.stack([torch.randperm(shape["experts"], generator=generator)[: shape["top_k"]]
                             for _ in range(tokens)]).to("tpu")  # fmt: skip
        weights = torch.softmax(torch.randn(tokens, shape["top_k"], generator=generator), -1).to(torch.bfloat16)
        weights = weights.to("tpu")
        first = None
        for form in forms:
            if form == "slots" and tokens * shape["top_k"] > experts_forms.MAX_SLOTS:
                continue
            forward = experts_forms._form_forward(form)
            torch._dynamo.reset()  # one graph per form (the same lambda's code would hit Dynamo's recompile limit)
            fn = torch.compile(lambda a, b, c, fw=forward: fw(module, a, b, c), backend="tpu", fullgraph=True,
                               dynamic=False)  # fmt: skip
            try:
                out = fn(x, index, weights).float().cpu()
                first = out if first is None else first
                rounds = [per_call(lambda fn=fn: fn(x, index, weights), 20) for _ in range(3)]
                rec(step="form", shape=name, tokens=tokens, form=form, seconds=min(rounds), rounds=rounds,
                    rel_err_vs_first=float((out - first).abs().max() / (first.abs().max() + 1e-9)))  # fmt: skip
            except Exception as exc:  # noqa: BLE001
                rec(step="form", shape=name, tokens=tokens, form=form, error=repr(exc)[:1200])


DECODE_MODELS = {
    # the Llama-3.2-1B shape, and the Qwen3-30B-A3B shape with 8 of its 48 layers (as many as fit the v5e's 15.75 GiB
    # with a batch-64 cache: 9.7 GB of experts), as chip_bench.py's lean steps
    "llama": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                  max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=500000.0)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, moe_intermediate_size=768,
                                         intermediate_size=6144, num_hidden_layers=8, num_attention_heads=32,
                                         num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                         max_position_embeddings=4096, tie_word_embeddings=False,
                                         rope_theta=1000000.0)),
}  # fmt: skip


# a small Llama for trying the prefill and serve stages on the simulated device (MODEL=smoke), not a chip figure
SMOKE_MODEL = ("LlamaConfig", dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=4096, tie_word_embeddings=True))  # fmt: skip


def _model_shape(name: str) -> tuple[str, dict]:
    return SMOKE_MODEL if name == "smoke" else DECODE_MODELS[name]


def _decode_model(name: str):
    """A ``DECODE_MODELS`` shape with random bf16 weights built on the chip (no checkpoint, no host copy)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    config_class, fields = _model_shape(name)
    config = getattr(transformers, config_class)(**fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="tpu").to(torch.bfloat16).requires_grad_(False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.bfloat16, device="tpu") * 0.02)
        rotary = model.model.rotary_emb
        for buffer_name, buffer in type(rotary)(config).named_buffers():
            getattr(rotary, buffer_name).copy_(buffer.to("tpu"))
    model.tie_weights()
    model.generation_config.eos_token_id = None  # every call runs its max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def stage_llama_decode() -> None:
    """hf_tpu's ``generate`` of a Llama-3.2-1B-shaped model (``MODEL=qwen3_moe``: the 8-layer Qwen3-30B-A3B shape,
    with the experts form hf_tpu picks on a TPU VM), prompt 512: the decode step from two calls that share graphs and
    a 640-slot cache (112 and 16 new tokens), per batch, per ``HF_TPU_KV_WRITE`` mode (``MODES``), per KV rows writer
    (``WRITERS``, ``HF_TPU_KV_ROWS_WRITER``: the tokens of each against the first's) and per number of steps
    dispatched ahead of a read-back (``READ_AHEAD``)."""
    import torch

    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    import hf_tpu

    hf_tpu.enable("generation")
    from hf_tpu.transformers._loops import readback

    name = os.environ.get("MODEL", "llama")
    model = _decode_model(name)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    for batch in _numbers(os.environ.get("BATCHES", "1 64")):
        ids = torch.randint(3, vocab - 8, (batch, 512), generator=generator)
        for mode in os.environ.get("MODES", "graph after").replace("+", " ").split():
            os.environ["HF_TPU_KV_WRITE"] = mode
            first_tokens = None
            for writer in os.environ.get("WRITERS", "auto").replace("+", " ").split():
                os.environ["HF_TPU_KV_ROWS_WRITER"] = writer

                def timed(n):
                    start = time.perf_counter()
                    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                         do_sample=False)  # fmt: skip
                    return time.perf_counter() - start, out

                first, _ = timed(16)
                for ahead in _numbers(os.environ.get("READ_AHEAD", str(readback.READ_AHEAD))):
                    readback.READ_AHEAD = ahead  # steps dispatched before a read-back waits (0: none)
                    short = min(timed(16)[0], timed(16)[0])
                    long, out = timed(112)
                    first_tokens = out if first_tokens is None else first_tokens
                    rec(step="decode", model=name, batch=batch, kv_write=mode, rows_writer=writer, read_ahead=ahead,
                        experts=getattr(model.config, "_experts_implementation", None), first_s=first,
                        short_s=short, long_s=long, step_s=(long - short) / 96, new_tokens=int(out.shape[1] - 512),
                        tokens_equal_first=bool(torch.equal(out, first_tokens)))  # fmt: skip


def stage_lean() -> None:
    """The references of the decode rows, measured in the same command: ``scripts/chip_bench.py``'s floor (the
    chip's streaming rate) and its lean JAX decode steps (``BATCHES``; ``MODELS``: ``llama``, ``moe``; ``FORMS``: the
    MoE step's experts forms, ``+``-separated), in the machine's own JAX, before a torch_tpu stage opens the chip
    (:func:`stage_env`); their records go to ``records.jsonl`` in chip_bench's own format (``chip_bench.py report``
    reads them). ``MODELS`` may also hold ``mmdit`` and ``train``: the lean references of the ``denoiser`` and
    ``train`` stages (``chip_bench.part_lean_images``; its ``LEAN_*`` knobs pass through)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import chip_bench

    os.environ["CHIP_BENCH_BATCHES"] = " ".join(str(b) for b in _numbers(os.environ.get("BATCHES", "1 64")))
    os.environ["CHIP_BENCH_LEAN"] = os.environ.get("MODELS", "llama moe").replace("+", " ").replace("_", " ")
    if "FORMS" in os.environ:
        os.environ["CHIP_BENCH_LEAN_FORMS"] = os.environ["FORMS"].replace("+", " ")
    chip_bench.part_floor(_OUT, quick=False)
    chip_bench.part_lean(_OUT, _OUT, quick=False)


def _matmul_rate(n: int = 8192) -> float:
    """The chip's bf16 matmul rate (FLOP/s) through torch_tpu: an ``n``-cube product compiled by its backend, the
    best of 3 rounds of 10 calls dispatched back to back (recorded)."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device="tpu")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="tpu")
    mm = torch.compile(lambda x, y: x @ y, backend="tpu", dynamic=False)
    seconds = min(per_call(lambda: mm(a, b), 10) for _ in range(3))
    rate = 2 * n**3 / seconds
    rec(step="matmul_rate", n=n, seconds=seconds, flops_per_s=rate)
    return rate


def prefill_flops(config, tokens: int) -> dict[str, int]:
    """FLOPs of one prefill of ``tokens`` prompt tokens (batch 1): the decoder layers' projections (2 per weight per
    token), causal attention (QK^T and PV over the lower triangle: 2 x 2 x tokens^2 / 2 x heads x head_dim per layer)
    and the LM head for the last token only (generate keeps one row of logits)."""
    d, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    per_layer = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2 + 3 * d * config.intermediate_size
    linear = 2 * tokens * layers * per_layer
    attention = layers * 2 * tokens * tokens * heads * head_dim  # (2 products x 2 FLOPs x tokens^2 / 2)
    head = 2 * d * config.vocab_size
    return {"linear": linear, "attention": attention, "head": head, "total": linear + attention + head}


def stage_prefill() -> None:
    """Prefill of the Llama-3.2-1B shape (random bf16 weights) through hf_tpu's ``generate`` with one new token, batch
    1, per prompt length (``LENGTHS``, default 512 and 2048): seconds (the best of 3 after the compiling call), its
    FLOPs (:func:`prefill_flops`) and their rate against the chip's bf16 matmul rate measured in the same stage."""
    import torch

    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    import hf_tpu

    hf_tpu.enable("generation")
    rate = _matmul_rate(int(os.environ.get("MATMUL_N", "8192")))
    name = os.environ.get("MODEL", "llama")
    model = _decode_model(name)
    generator = torch.Generator().manual_seed(0)
    for tokens in _numbers(os.environ.get("LENGTHS", "512 2048")):
        ids = torch.randint(3, model.config.vocab_size - 8, (1, tokens), generator=generator)

        def call(ids=ids):
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                                 do_sample=False)  # fmt: skip
            int(out[0, -1])  # the token read back: the whole prefill done
            return time.perf_counter() - start

        first = call()
        rounds = [call() for _ in range(3)]
        flops = prefill_flops(model.config, tokens)
        seconds = min(rounds)
        rec(step="prefill", model=name, tokens=tokens, first_s=first, seconds=seconds, rounds=rounds,
            flops=flops, flops_per_s=flops["total"] / seconds, matmul_rate=rate,
            fraction_of_matmul_rate=flops["total"] / seconds / rate)  # fmt: skip


def _uds(path: str, method: str, url: str, body: dict | None = None, timeout: float = 600.0):
    from hf_tpu.serving.uds import UnixHTTPConnection

    conn = UnixHTTPConnection(path, timeout)
    conn.request(method, url, json.dumps(body) if body is not None else None,
                 {"content-type": "application/json"} if body is not None else {})  # fmt: skip
    return conn, conn.getresponse()


def _served_model(path: str, name: str = "llama") -> str:
    """The Llama-3.2-1B shape with random bf16 weights, saved with a word-level tokenizer of its whole vocabulary
    (token ``i`` is the word ``t{i}``), so that a prompt of ``n`` words is ``n`` tokens and any id decodes."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    config_class, fields = _model_shape(name)
    config = getattr(transformers, config_class)(**fields, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).mul_(0.02))
        rotary = model.model.rotary_emb
        for name, buffer in type(rotary)(config).named_buffers():
            getattr(rotary, name).copy_(buffer)
    model.tie_weights()
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", pad_token="t2",
                            unk_token="t3").save_pretrained(path)  # fmt: skip
    return path


def _stream(sock: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion (greedy, no end of sequence, usage chunk asked): its times and token count."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    conn, response = _uds(sock, "POST", "/v1/completions", body)
    first, tokens, status = None, None, response.status
    try:
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if first is None and any(c.get("text") for c in payload.get("choices", [])):
                first = time.perf_counter()
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
    finally:
        conn.close()
    end = time.perf_counter()
    return {"status": status, "start": start, "first": first, "end": end, "tokens": tokens}


def _load(sock: str, streams: int, prompt_tokens: int, new_tokens: int, seed: int, vocab: int) -> dict:
    """``streams`` streamed completions sent at once (one thread each): tokens/s, TTFT and TPOT p50/p99."""
    import random
    import threading

    rng = random.Random(seed)
    prompts = [" ".join(f"t{rng.randint(10, vocab - 1)}" for _ in range(prompt_tokens)) for _ in range(streams)]
    results: list[dict] = [{}] * streams

    def one(i: int) -> None:
        try:
            results[i] = _stream(sock, prompts[i], new_tokens)
        except Exception as exc:  # noqa: BLE001 - counted as a failed request
            results[i] = {"error": repr(exc)[:300]}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in results if r.get("status") == 200 and r.get("tokens") and r.get("first")]
    ttft = sorted(r["first"] - r["start"] for r in done)
    tpot = sorted((r["end"] - r["first"]) / max(1, r["tokens"] - 1) for r in done)

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    wall = (max(r["end"] for r in done) - min(r["start"] for r in done)) if done else None
    tokens = sum(r["tokens"] for r in done)
    return {"streams": streams, "answered": len(done), "errors": [r for r in results if r not in done][:3],
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99), "tpot_p50_s": pct(tpot, 0.5),
            "tpot_p99_s": pct(tpot, 0.99)}  # fmt: skip


def _metric(sock: str, name: str) -> float | None:
    conn, response = _uds(sock, "GET", "/metrics")
    try:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    finally:
        conn.close()
    return None


def _start_server(path: str, sock: str, flags: list[str], log: Path, limit_s: float):
    """``hf-tpu serve`` on a unix socket in its own session; returns (process, seconds to ready) once ``/health``
    says 200, or raises with the log's end."""
    import signal

    if os.path.exists(sock):
        os.unlink(sock)
    env = stage_env()
    start = time.perf_counter()
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "hf_tpu.cli", "serve", path, "--uds", sock, *flags],
                                stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
    while True:
        if proc.poll() is not None or time.perf_counter() - start > limit_s:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"hf-tpu serve did not get ready: {log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(OSError):
            conn, response = _uds(sock, "GET", "/health", timeout=10)
            conn.close()
            if response.status == 200:
                return proc, time.perf_counter() - start
        time.sleep(1.0)


def _stop_server(proc) -> None:
    import signal

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
            return
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _warmup_line(log: Path) -> dict:
    import re

    pattern = r"warm-up done in ([\d.]+) s \((\d+) step shapes, (\d+) graphs compiled\)"
    found = re.findall(pattern, log.read_text(errors="replace"))
    if not found:
        return {}
    seconds, shapes, compiled = found[-1]
    return {"warmup_s": float(seconds), "step_shapes": int(shapes), "graphs_compiled": int(compiled)}


def stage_serve() -> None:
    """``hf-tpu serve`` of the Llama-3.2-1B shape (random bf16 weights, :func:`_served_model`) on a unix socket,
    under ``STREAMS`` (default 1 8 32 64) concurrent streamed completions of ``PROMPT`` (128) prompt tokens and ``NEW``
    (128) new tokens each: tokens/s, TTFT and TPOT p50/p99, compiles after the warm-up (``/metrics``). Then the
    server again on the same ``--compile-cache`` folder: the graphs it compiled at start (0 expected) and its seconds
    to ready. ``FLAGS``: the server's options (``+`` for spaces)."""
    name = os.environ.get("MODEL", "llama")
    work = Path(os.environ.get("WORK", "/tmp/hf_tpu_chip_serve"))
    work.mkdir(exist_ok=True, parents=True)
    path = str(work / f"model-{name}")
    start = time.perf_counter()
    if not (Path(path) / "config.json").exists():
        _served_model(path, name)
    rec(step="model", path=path, seconds=time.perf_counter() - start)
    sock, cache = str(work / "serve.sock"), str(work / "compile-cache")
    flags = os.environ.get("FLAGS", "--slots+64+--max-pending+512+--kv-cache-gib+2+--min-step-tokens+64+"
                                    "--max-batch-tokens+256").split("+")  # fmt: skip
    flags += ["--compile-cache", cache]
    prompt, new = int(os.environ.get("PROMPT", "128")), int(os.environ.get("NEW", "128"))
    for attempt in ("first", "cached"):
        log = _OUT / f"serve-{attempt}.log"
        proc, ready_s = _start_server(path, sock, flags, log, limit_s=float(os.environ.get("READY_S", "420")))
        try:
            rec(step="ready", model=name, attempt=attempt, seconds=ready_s, flags=flags, **_warmup_line(log))
            if attempt == "cached":
                break
            before = _metric(sock, "hf_tpu_compiles_total")
            for i, streams in enumerate(_numbers(os.environ.get("STREAMS", "1 8 32 64"))):
                figures = _load(sock, streams, prompt, new, seed=i, vocab=_model_shape(name)[1]["vocab_size"])
                rec(step="load", prompt_tokens=prompt, new_tokens=new, **figures,
                    compiles_after_warmup=(_metric(sock, "hf_tpu_compiles_total") or 0) - (before or 0))  # fmt: skip
        finally:
            _stop_server(proc)


# ---------------------------------------------------------------------------------------------------------------
# Images (issue #68): an SD3.5-medium-shaped denoiser through hf_tpu's diffusers path, and its FLOPs
# ---------------------------------------------------------------------------------------------------------------

# stabilityai/stable-diffusion-3.5-medium's transformer/config.json (MMDiT-X: 24 joint blocks, the first 13 with a
# second, image-only attention; RMS-normed q and k); ``SD3Transformer2DModel(**fields)``
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")  # fmt: skip
# the same blocks at toy widths, for the simulated device (MODEL=smoke)
SMOKE_MMDIT = dict(sample_size=8, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=32,
                   out_channels=16, pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm")  # fmt: skip
# SD3's VAE (stabilityai/stable-diffusion-3.5-medium vae/config.json): 16 latent channels, 8x down
SD3_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
               down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
               layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609,
               use_quant_conv=False, use_post_quant_conv=False)  # fmt: skip
SMOKE_VAE = dict(SD3_VAE, block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                 up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, norm_num_groups=2, sample_size=32)
# the text encoders' widths the SD3 pipeline joins: CLIP-L and CLIP-G hidden sizes (their projections concatenated
# are the pooled projection), T5-XXL's d_model (the joint attention width); 77 CLIP tokens + 256 T5 tokens
SD3_TEXT = dict(clip=(768, 1280), t5=4096, clip_tokens=77, t5_tokens=256)
SMOKE_TEXT = dict(clip=(16, 16), t5=64, clip_tokens=77, t5_tokens=16)
# black-forest-labs/FLUX.1-dev's transformer/config.json (``FluxTransformer2DModel(**fields)``): 19 double-stream and
# 38 single-stream blocks of width 3072, 11.9B parameters (23.8 GB in bf16: more than a v5e's HBM); the stage keeps
# FLUX_FIT of them by default, 5.0B parameters (10 GB) with room for 1024x1024's activations
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))  # fmt: skip
FLUX_FIT = (8, 16)  # (double-stream, single-stream) blocks
SMOKE_FLUX = dict(FLUX_DEV, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                  joint_attention_dim=64, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))  # fmt: skip
FLUX_TEXT = dict(clip=(768,), t5=4096, clip_tokens=77, t5_tokens=512)  # FLUX.1-dev: CLIP-L pooled, 512 T5 tokens
SMOKE_FLUX_TEXT = dict(clip=(16,), t5=64, clip_tokens=77, t5_tokens=16)


def mmdit_flops(config: dict, latent_h: int, latent_w: int, text_tokens: int, batch: int = 1) -> dict[str, int]:
    """Matmul FLOPs (2 per multiply-add) of one ``SD3Transformer2DModel`` forward on ``latent_h`` x ``latent_w``
    latents (``config``: its fields; SD3's VAE makes a 1024-pixel side 128 latents), ``text_tokens`` (77 + 256 in
    SD3) and ``batch`` rows: ``linear`` (the patch embedding, the timestep/pooled embedders, the caption projection,
    each block's modulation, q/k/v/out of both streams, the MLPs, the MMDiT-X blocks' second attention, the output
    projection) and ``attention`` (QK^T and PV of the joint attention over image + text tokens and of the image-only
    second attention, whole squares: nothing is causal)."""
    p, c = config["patch_size"], config["in_channels"]
    d = config["num_attention_heads"] * config["attention_head_dim"]
    n = (latent_h // p) * (latent_w // p)  # image tokens
    t = text_tokens
    layers = config["num_layers"]
    dual = sum(1 for i in config.get("dual_attention_layers", ()) if i < layers)
    per_row = 256 * d + d * d + config["pooled_projection_dim"] * d + d * d  # timestep and pooled-text embedders
    per_row += d * 2 * d + layers * 6 * d * d + dual * 3 * d * d  # norm_out's, norm1's modulation (6 rows; X: 9)
    per_row += (layers - 1) * 6 * d * d + 2 * d * d  # norm1_context's: 6 rows, the last block's continuous norm 2
    image = c * p * p * d + layers * (4 * d * d + 8 * d * d) + dual * 4 * d * d + d * p * p * config["out_channels"]
    text = config["joint_attention_dim"] * config["caption_projection_dim"] + layers * 3 * d * d
    text += (layers - 1) * (d * d + 8 * d * d)  # the last block drops the text stream's out projection and MLP
    linear = 2 * batch * (per_row + n * image + t * text)
    attention = 2 * 2 * batch * d * (layers * (n + t) ** 2 + dual * n * n)
    return {"linear": linear, "attention": attention, "total": linear + attention}


def flux_flops(config: dict, image_tokens: int, text_tokens: int, batch: int = 1) -> dict[str, int]:
    """Matmul FLOPs of one ``FluxTransformer2DModel`` forward on ``image_tokens`` packed latent tokens (a 1024-pixel
    square: 4096) and ``text_tokens`` T5 tokens, ``batch`` rows: ``linear`` (the latent and text embedders, the
    timestep, guidance and pooled-text embedders, each block's modulation, the double-stream blocks' q/k/v/out and
    MLPs of both streams, the single-stream blocks' fused q/k/v + MLP and output projection, the final projection)
    and ``attention`` (QK^T and PV over image + text tokens in every block, whole squares)."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    double, single = config["num_layers"], config["num_single_layers"]
    n, t = image_tokens, text_tokens
    embedders = 2 if config.get("guidance_embeds") else 1
    per_row = embedders * (256 * d + d * d) + config["pooled_projection_dim"] * d + d * d
    per_row += double * 12 * d * d + single * 3 * d * d + 2 * d * d  # the blocks' and norm_out's modulations
    out_channels = config.get("out_channels") or config["in_channels"]
    image = config["in_channels"] * d + double * 12 * d * d + d * config["patch_size"] ** 2 * out_channels
    text = config["joint_attention_dim"] * d + double * 12 * d * d
    joint = single * (3 * d * d + 4 * d * d + 5 * d * d)  # q/k/v, the MLP's up, proj_out over [attention, MLP]
    linear = 2 * batch * (per_row + n * image + t * text + (n + t) * joint)
    attention = 2 * 2 * batch * d * (double + single) * (n + t) ** 2
    return {"linear": linear, "attention": attention, "total": linear + attention}


def _compile_counts() -> dict[str, int]:
    """Graphs dynamo compiled in this process and torch_tpu's compilation-cache misses (eager op signatures and graphs
    it compiled; ``torch.tpu._get_cache_stats()``, the simulator answers the same): subtract two for what happened
    in between."""
    from torch._dynamo.utils import counters

    from hf_tpu._torch_tpu import cache_stats

    stats = cache_stats()
    return {"graphs": int(counters["stats"]["unique_graphs"]), "tpu_cache_misses": stats.misses if stats else -1}


def _since(before: dict[str, int]) -> dict[str, int]:
    now = _compile_counts()
    return {k: now[k] - before[k] for k in now}


def _random_on_tpu(module, dtype, std: float = 0.02):
    """``module`` (built on the meta device) on the chip in ``dtype`` with N(0, std) weights drawn there (no host copy
    of its weights), norm weights 1 and biases 0. Its buffers are left uninitialised: the caller fills them."""
    import torch

    module = module.to_empty(device="tpu").to(dtype).requires_grad_(False).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, dtype=dtype, device="tpu") * std)
    return module


def _mmdit(config: dict, dtype):
    """An ``SD3Transformer2DModel`` of ``config`` with random ``dtype`` weights on the chip; its buffers (the 2-D
    sin-cos position table) from a host copy of the model with one block."""
    import torch
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        model = SD3Transformer2DModel(**config)
    model = _random_on_tpu(model, dtype)
    small = SD3Transformer2DModel(**{**config, "num_layers": 1, "dual_attention_layers": ()})
    own = dict(small.named_buffers())
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(own[name].to(buffer.dtype))  # raises if a block held a buffer: none does
    return model


def _text_encoders(text: dict, dtype, projection: bool = True):
    """Tiny text encoders of the real widths (one layer each: they run once per image, the denoiser every step; the
    real T5-XXL alone is 9.5 GB in bf16): a CLIP per ``text["clip"]`` width (with a projection of that width where
    ``projection``), a T5 encoder of d_model ``text["t5"]``, hf_tpu's character-level tokenizers (``clip_tokens`` CLIP
    tokens, ``t5_tokens`` T5 tokens)."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from hf_tpu.diffusers.testing import clip_tokenizer, t5_tokenizer

    torch.manual_seed(0)
    toks = [clip_tokenizer(text["clip_tokens"]) for _ in text["clip"]]
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    clips = [cls(CLIPTextConfig(
        hidden_size=width, intermediate_size=2 * width, num_attention_heads=max(width // 64, 1), num_hidden_layers=1,
        max_position_embeddings=text["clip_tokens"], vocab_size=len(toks[0]), projection_dim=width, bos_token_id=0,
        eos_token_id=1, pad_token_id=1)).to(dtype) for width in text["clip"]]  # fmt: skip
    tok_t5 = t5_tokenizer(text["t5_tokens"])
    t5 = T5EncoderModel(T5Config(vocab_size=len(tok_t5), d_model=text["t5"], d_kv=64, d_ff=256, num_layers=1,
                                 num_heads=4, relative_attention_num_buckets=32, pad_token_id=0, eos_token_id=1,
                                 decoder_start_token_id=0)).to(dtype)  # fmt: skip
    return clips, toks, t5, tok_t5


def _sd3_pipeline(mmdit: dict, vae: dict, text: dict, dtype):
    """A ``StableDiffusion3Pipeline`` of the given transformer and VAE shapes (random weights, built on the chip) with
    :func:`_text_encoders` (CLIP-L and CLIP-G with projections, T5)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    clips, toks, t5, tok_t5 = _text_encoders(text, dtype)
    with torch.device("meta"):
        vae_model = AutoencoderKL(**vae)
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), text_encoder=clips[0], tokenizer=toks[0],
        text_encoder_2=clips[1], tokenizer_2=toks[1], text_encoder_3=t5, tokenizer_3=tok_t5,
        transformer=_mmdit(mmdit, dtype), vae=_random_on_tpu(vae_model, dtype))  # fmt: skip


def _flux_pipeline(config: dict, vae: dict, text: dict, dtype):
    """A ``FluxPipeline`` of the given transformer and VAE shapes (random weights, built on the chip; FLUX.1's VAE
    scale and shift, its dynamic-shift scheduler) with :func:`_text_encoders` (CLIP-L's pooled output, T5)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    clips, toks, t5, tok_t5 = _text_encoders(text, dtype, projection=False)
    with torch.device("meta"):
        vae_model = AutoencoderKL(**{**vae, "scaling_factor": 0.3611, "shift_factor": 0.1159})
        transformer = FluxTransformer2DModel(**config)
    transformer = _random_on_tpu(transformer, dtype)  # (no buffers: the rotary table is computed per call)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)  # fmt: skip
    return FluxPipeline(scheduler=scheduler, text_encoder=clips[0], tokenizer=toks[0], text_encoder_2=t5,
                        tokenizer_2=tok_t5, transformer=transformer, vae=_random_on_tpu(vae_model, dtype))  # fmt: skip


def _denoiser_case(smoke: bool):
    """What ``SHAPE`` (``sd35`` or ``flux``) makes the denoiser stage build and call: (pipeline, its transformer's
    config, text widths, default guidance, ``inputs(batch)`` (the transformer's keywords as the pipeline passes them:
    the same graph), ``flops(batch)``, latent side, tokens)."""
    import torch

    shape = os.environ.get("SHAPE", "sd35")
    size = int(os.environ.get("SIZE", "32" if smoke else "1024"))
    vae = SMOKE_VAE if smoke else SD3_VAE
    latent = size // 2 ** (len(vae["block_out_channels"]) - 1)
    dtype = torch.bfloat16

    def tpu(t):
        return t.to(dtype).to("tpu")

    if shape == "flux":
        config, text = (SMOKE_FLUX, SMOKE_FLUX_TEXT) if smoke else (FLUX_DEV, FLUX_TEXT)
        double = int(os.environ.get("LAYERS", config["num_layers"] if smoke else FLUX_FIT[0]))
        single = int(os.environ.get("SINGLE_LAYERS", config["num_single_layers"] if smoke else FLUX_FIT[1]))
        config = dict(config, num_layers=double, num_single_layers=single)
        pipe = _flux_pipeline(config, vae, text, dtype)
        image_tokens, tokens = (latent // 2) ** 2, text["t5_tokens"]

        def inputs(batch, g):
            ids = torch.zeros(image_tokens, 3)
            ids[:, 1] = torch.arange(latent // 2).repeat_interleave(latent // 2)
            ids[:, 2] = torch.arange(latent // 2).repeat(latent // 2)
            return dict(hidden_states=tpu(torch.randn(batch, image_tokens, config["in_channels"], generator=g)),
                        timestep=tpu(torch.full((batch,), 0.5)),
                        guidance=torch.full([1], 3.5, device="tpu").expand(batch),
                        pooled_projections=tpu(torch.randn(batch, text["clip"][0], generator=g)),
                        encoder_hidden_states=tpu(torch.randn(batch, tokens, text["t5"], generator=g)),
                        txt_ids=tpu(torch.zeros(tokens, 3)), img_ids=tpu(ids),
                        joint_attention_kwargs={},  # FluxPipeline passes a dict (None would be another graph)
                        return_dict=False)  # fmt: skip

        def flops(batch):
            return flux_flops(config, image_tokens, tokens, batch)

        return pipe, config, text, 3.5, inputs, flops, size, latent, tokens
    mmdit, text = (SMOKE_MMDIT, SMOKE_TEXT) if smoke else (SD35_MEDIUM, SD3_TEXT)
    if "LAYERS" in os.environ:
        layers = int(os.environ["LAYERS"])
        mmdit = dict(mmdit, num_layers=layers, dual_attention_layers=tuple(i for i in mmdit["dual_attention_layers"]
                                                                           if i < layers))  # fmt: skip
    pipe = _sd3_pipeline(mmdit, vae, text, dtype)
    tokens = text["clip_tokens"] + text["t5_tokens"]

    def inputs(batch, g):
        return dict(hidden_states=tpu(torch.randn(batch, mmdit["in_channels"], latent, latent, generator=g)),
                    timestep=torch.full((batch,), 500.0, device="tpu"),
                    encoder_hidden_states=tpu(torch.randn(batch, tokens, text["t5"], generator=g)),
                    pooled_projections=tpu(torch.randn(batch, sum(text["clip"]), generator=g)),
                    joint_attention_kwargs=None, return_dict=False)  # fmt: skip

    def flops(batch):
        return mmdit_flops(mmdit, latent, latent, tokens, batch)

    return pipe, mmdit, text, 4.5, inputs, flops, size, latent, tokens


def stage_denoiser() -> None:
    """An SD3.5-medium-shaped MMDiT (random bf16 weights) as a user runs it: a ``StableDiffusion3Pipeline`` of it with
    an SD3-shaped VAE and tiny text encoders of the real widths (:func:`_sd3_pipeline`), ``pipe.to("tpu")``, hf_tpu's
    ``compile_pipeline(pipe, vae=True)``, at ``SIZE`` (1024) pixels. Records: the warm-up call's seconds and compiles;
    a whole pipeline call of ``STEPS`` (28) steps with classifier-free guidance (``GUIDANCE`` 4.5: batch 2 through the
    denoiser) and its compiles; the denoiser step alone, called as the pipeline calls it, per batch (``BATCHES``,
    "2 1"; the best of 3 rounds of ``CALLS`` (3) calls), its FLOPs (:func:`mmdit_flops`) and fraction of the chip's
    bf16 matmul rate measured here; the VAE decode of one latent; and hf_tpu's tiny pipeline's image against the
    CPU's (float32 at 'highest' precision). ``LAYERS`` narrows the transformer (dual-attention blocks kept among the
    first 13). ``SHAPE=flux``: a FLUX.1-dev-shaped transformer in a ``FluxPipeline`` instead (guidance embedded, no
    CFG: batch 1; ``LAYERS`` double-stream and ``SINGLE_LAYERS`` single-stream blocks, FLUX_FIT by default: the whole
    model does not fit the chip; :func:`flux_flops`). ``MODEL=smoke``: toy widths for the simulated device."""
    import torch

    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    import hf_tpu

    hf_tpu.enable("diffusers")
    from hf_tpu.diffusers import compile_pipeline

    smoke = os.environ.get("MODEL", "sd35") == "smoke"
    rate = _matmul_rate(int(os.environ.get("MATMUL_N", "256" if smoke else "8192")))
    steps = int(os.environ.get("STEPS", "4" if smoke else "28"))
    start = time.perf_counter()
    pipe, config, text, guidance, inputs, flops_of, size, latent, tokens = _denoiser_case(smoke)
    guidance = float(os.environ.get("GUIDANCE", guidance))
    pipe.set_progress_bar_config(disable=True)
    pipe.to("tpu")
    params = sum(p.numel() for p in pipe.transformer.parameters())
    rec(step="pipeline", pipeline=type(pipe).__name__, config=config, params=params,
        vae_params=sum(p.numel() for p in pipe.vae.parameters()), text=text, size=size,
        seconds=time.perf_counter() - start)  # fmt: skip
    compile_pipeline(pipe, vae=os.environ.get("VAE", "1") == "1")  # VAE=0: the VAE eager
    call = dict(prompt="a watercolor fox in the snow", height=size, width=size, guidance_scale=guidance,
                max_sequence_length=text["t5_tokens"], output_type="np")  # fmt: skip

    def image(n_steps):
        started = time.perf_counter()
        out = pipe(**call, num_inference_steps=n_steps, generator=torch.Generator("cpu").manual_seed(0)).images
        return time.perf_counter() - started, out

    whole = os.environ.get("PIPELINE", "1") == "1"  # PIPELINE=0: the denoiser's step alone (and the VAE's decode)
    before = _compile_counts()
    seconds, _ = image(2) if whole else (None, None)
    rec(step="warmup_call", steps=2, seconds=seconds, compiles=_since(before))
    before = _compile_counts()
    seconds, out = image(steps) if whole else (None, torch.zeros(1))
    rec(step="pipeline_call", steps=steps, guidance=guidance, seconds_per_image=seconds, compiles=_since(before),
        image_finite=bool(torch.isfinite(torch.as_tensor(out)).all()))  # fmt: skip
    cfg_batch = 2 if guidance > 1 and type(pipe).__name__ != "FluxPipeline" else 1
    default = f"{cfg_batch} {3 - cfg_batch}" if cfg_batch == 2 else "1"
    for batch in _numbers(os.environ.get("BATCHES", default)):
        kwargs = inputs(batch, torch.Generator().manual_seed(batch))
        before = _compile_counts()
        started = time.perf_counter()
        with torch.no_grad():
            pipe.transformer(**kwargs)[0].float().sum().item()
            first = time.perf_counter() - started
            warm = _since(before)
            before = _compile_counts()
            rounds = [per_call(lambda kwargs=kwargs: pipe.transformer(**kwargs), int(os.environ.get("CALLS", "3")))
                      for _ in range(3)]  # fmt: skip
        flops = flops_of(batch)
        best = min(rounds)
        rec(step="denoiser_step", batch=batch, size=size, text_tokens=tokens, first_s=first, seconds=best,
            rounds=rounds, flops=flops, flops_per_s=flops["total"] / best, matmul_rate=rate,
            fraction_of_matmul_rate=flops["total"] / best / rate, compiles_first_call=warm,
            compiles_after_warmup=_since(before))  # fmt: skip
    scale, shift = pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor
    z = torch.randn(1, 16, latent, latent, generator=torch.Generator().manual_seed(0)) / scale + shift
    z = z.to(torch.bfloat16).to("tpu")
    with torch.no_grad():
        before = _compile_counts()
        started = time.perf_counter()
        pipe.vae.decode(z, return_dict=False)[0].float().sum().item()
        first = time.perf_counter() - started
        warm = _since(before)
        before = _compile_counts()
        decode = min(per_call(lambda: pipe.vae.decode(z, return_dict=False), 2) for _ in range(2))
    rec(step="vae_decode", size=size, first_s=first, seconds=decode, compiles_first_call=warm,
        compiles_after_warmup=_since(before))  # fmt: skip
    flux = type(pipe).__name__ == "FluxPipeline"
    pipe = None  # the big pipeline's memory back before the tiny one
    _tiny_pipeline_against_cpu(flux)


def _tiny_pipeline_against_cpu(flux: bool = False) -> None:
    """hf_tpu's tiny SD3 pipeline (16 latent channels; ``flux``: its tiny Flux pipeline), float32, on the chip,
    compiled by ``compile_pipeline``, against the same pipeline on the CPU: the image's largest difference (matmuls at
    'highest' precision here, then 'medium', torch_tpu's default)."""
    import copy

    import torch

    from hf_tpu.diffusers import compile_pipeline
    from hf_tpu.diffusers.testing import tiny_flux_pipeline, tiny_sd3_pipeline

    cpu = tiny_flux_pipeline() if flux else tiny_sd3_pipeline(latent_channels=16)
    cpu.set_progress_bar_config(disable=True)
    call = dict(prompt="a lighthouse", height=32, width=32, num_inference_steps=4, output_type="np")
    want = cpu(**call, generator=torch.Generator("cpu").manual_seed(0)).images
    pipe = copy.deepcopy(cpu).to("tpu")
    compile_pipeline(pipe)
    for precision in ("highest", "medium"):
        torch.set_float32_matmul_precision(precision)
        got = pipe(**call, generator=torch.Generator("cpu").manual_seed(0)).images
        rec(step="tiny_pipeline_vs_cpu", pipeline=type(cpu).__name__, precision=precision,
            max_abs_err=float(abs(got - want).max()), pixels=int(want.size))  # fmt: skip
    torch.set_float32_matmul_precision("medium")


# ---------------------------------------------------------------------------------------------------------------
# Training (issue #68): transformers.Trainer on a Llama shape through hf_tpu's training integration
# ---------------------------------------------------------------------------------------------------------------


def train_flops(config, batch: int, seq: int, lora: bool = False) -> dict[str, int]:
    """Matmul FLOPs of one training step on ``batch`` rows of ``seq`` tokens of a Llama ``config``: the forward's
    projections and LM head over every token (2 per weight per token), and its causal attention (QK^T and PV over
    the lower triangle); the backward is twice the forward (the input's and the weight's gradient of each product),
    so the step is 3x, the "6 x params x tokens + attention" count. With ``lora`` the frozen weights get no gradient:
    2x the forward (the adapters' own products left out: under 1%)."""
    d, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    tokens = batch * seq
    weights = layers * (d * heads * head_dim * 2 + d * kv_heads * head_dim * 2 + 3 * d * config.intermediate_size)
    weights += d * config.vocab_size
    forward_linear = 2 * tokens * weights
    forward_attention = layers * 2 * batch * seq * seq * heads * head_dim  # (2 products x 2 FLOPs x seq^2 / 2)
    factor = 2 if lora else 3
    return {"matmul_params": weights, "linear": factor * forward_linear, "attention": factor * forward_attention,
            "total": factor * (forward_linear + forward_attention)}  # fmt: skip


def train_state_bytes(config, bytes_per_value: int = 2, lora: bool = False) -> dict[str, int]:
    """Bytes of the training state of a Llama ``config`` with every weight in one dtype (bf16: 2 bytes): the weights,
    their gradients and AdamW's two moments (made like the weights); with ``lora`` the frozen weights only."""
    d, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    per_layer = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2 + 3 * d * config.intermediate_size + 2 * d
    params = layers * per_layer + d * config.vocab_size * (1 if config.tie_word_embeddings else 2) + d
    weights = params * bytes_per_value
    trained = 0 if lora else weights
    return {"params": params, "weights": weights, "grads": trained, "adamw": 2 * trained,
            "total": weights + 3 * trained}  # fmt: skip


def train_activation_bytes(config, batch: int, seq: int) -> int:
    """A rough upper estimate of what a bf16 step keeps for the backward: per layer and token the normed inputs, q, k,
    v, the attention output, the MLP's gate, up and their product (2 bytes each), and the logits (bf16, their float32
    copy for the loss and its gradient)."""
    d, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    per_token = 2 * (4 * d + 2 * heads * head_dim + 2 * kv_heads * head_dim + 4 * inter)
    return batch * seq * (config.num_hidden_layers * per_token + config.vocab_size * (2 + 4 + 4))


def _hbm_bytes() -> int:
    import torch

    try:
        return int(torch.tpu.get_device_properties(0).total_memory)
    except Exception:  # noqa: BLE001 - a generation torch_tpu does not know, or the simulator without one
        return int(15.75 * 2**30)


def _train_model(name: str, layers: int | None, dtype):
    """A Llama shape (``_model_shape``) with ``layers`` layers, random ``dtype`` weights drawn on the chip (the
    rotary buffers from the host), no KV cache in the forward."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    config_class, fields = _model_shape(name)
    depth = layers or fields["num_hidden_layers"]
    config = getattr(transformers, config_class)(**{**fields, "num_hidden_layers": depth})
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="tpu").to(dtype)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, dtype=dtype, device="tpu") * 0.02)
        rotary = model.model.rotary_emb
        for buffer_name, buffer in type(rotary)(config).named_buffers():
            getattr(rotary, buffer_name).copy_(buffer.to("tpu"))
    model.tie_weights()
    return model.train()


def _step_callback():
    """A ``TrainerCallback`` that waits for the chip at the end of each optimizer step and records its seconds and the
    compiles in it (:func:`_compile_counts`; hf_tpu's ``StepCounters`` counts the simulator's only)."""
    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        def __init__(self):
            self.steps, self._mark = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self._mark = (time.perf_counter(), _compile_counts())

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            started, before = self._mark
            self.steps.append({"seconds": time.perf_counter() - started, **_since(before)})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and self.steps:
                self.steps[-1]["loss"] = float(logs["loss"])

    return Steps()


def _trainer(model, rows: list[dict], seq: int, batch: int, steps: int, out: str, ga: int = 1, use_cpu=False,
             log_every: int = 10**6, callbacks=(), optim: str = "adamw_torch", bf16: bool = True):  # fmt: skip
    from transformers import Trainer, TrainingArguments

    from hf_tpu.training import BucketingCollator

    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=ga, max_steps=steps,
        learning_rate=1e-4, lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=log_every, report_to=[],
        save_strategy="no", seed=0, use_cpu=use_cpu, bf16=bf16, optim=optim, dataloader_pin_memory=False,
        disable_tqdm=True)  # fmt: skip
    collate = BucketingCollator(buckets=(seq,), pad_token_id=0, batch_size=batch, return_attention_mask=False)
    return Trainer(model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=list(callbacks))


def _rows(n: int, seq: int, vocab: int, seed: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, vocab, (seq,), generator=g).tolist()} for _ in range(n)]


def stage_train() -> None:
    """``transformers.Trainer`` with ``hf_tpu.enable()`` on a Llama-3.2-1B shape (``MODEL``; random bf16 weights
    drawn on the chip, ``bf16=True`` (``BF16=0``: False), AdamW (``OPTIM``, Trainer's name, default ``adamw_torch``),
    max_grad_norm 1) on ``BATCH`` (1) rows of ``SEQ`` (1024) tokens, ``GA`` (1) micro-batches per step, the model
    compiled in place by torch_tpu (``COMPILE=0``: eager), ``STEPS`` (8) optimizer steps. Weights + gradients +
    AdamW states in bf16 are 8 bytes a parameter (9.9 GB for the 1B shape): ``LAYERS`` (default: the most that fit
    with the step's activations in 90% of the chip's HBM, :func:`train_state_bytes`, :func:`train_activation_bytes`)
    sets the depth, and the record says which and why. ``LORA=1``: peft LoRA (r 16 on every projection) on the
    frozen weights. Records the median step after the first 2 (each step waited for), tokens/s, the FLOPs
    (:func:`train_flops`) against the chip's bf16 matmul rate measured here, the compiles in each step (0 expected
    after step 2) and the device memory after step 2; then (``CURVE_STEPS``, 20; 0: none) a tiny Llama's loss curve
    under the Trainer on the chip and on the CPU (float32, same weights, data and seed): the largest difference."""
    import statistics

    import torch

    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    import hf_tpu

    lora = os.environ.get("LORA", "0") == "1"
    hf_tpu.enable("training", *(("peft",) if lora else ()))
    name = os.environ.get("MODEL", "llama")
    smoke = name == "smoke"
    rate = _matmul_rate(int(os.environ.get("MATMUL_N", "256" if smoke else "8192")))
    batch, seq = int(os.environ.get("BATCH", "1")), int(os.environ.get("SEQ", "64" if smoke else "1024"))
    ga, steps = int(os.environ.get("GA", "1")), int(os.environ.get("STEPS", "8"))
    import transformers

    config_class, fields = _model_shape(name)
    full = getattr(transformers, config_class)(**fields)
    budget = int(0.9 * _hbm_bytes())
    if "LAYERS" in os.environ:
        layers = int(os.environ["LAYERS"])
    else:
        layers = full.num_hidden_layers
        while layers > 1:
            config = getattr(transformers, config_class)(**{**fields, "num_hidden_layers": layers})
            if train_state_bytes(config, lora=lora)["total"] + train_activation_bytes(config, batch, seq) <= budget:
                break
            layers -= 1
    config = getattr(transformers, config_class)(**{**fields, "num_hidden_layers": layers})
    state, activations = train_state_bytes(config, lora=lora), train_activation_bytes(config, batch, seq)
    rec(step="train_shape", model=name, layers=layers, of_layers=full.num_hidden_layers, batch=batch, seq=seq, ga=ga,
        lora=lora, state_bytes=state, activation_bytes_estimate=activations, budget_bytes=budget,
        why="LAYERS given" if "LAYERS" in os.environ else
        "the most layers whose bf16 weights + grads + AdamW states + activations fit 90% of HBM")  # fmt: skip
    model = _train_model(name, layers, torch.bfloat16)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))  # fmt: skip
    if os.environ.get("COMPILE", "1") == "1":
        model.compile(backend="tpu", dynamic=False)
    rows = _rows((steps + 1) * batch * ga, seq, config.vocab_size - 8, seed=0)
    from hf_tpu.training import MemoryReport

    steps_cb, memory = _step_callback(), MemoryReport(at_step=2)  # (the device bytes right after step 2's update)
    autocast = os.environ.get("BF16", "1") == "1"  # 0: no autocast (the weights are bf16 either way)
    trainer = _trainer(model, rows, seq, batch, steps, f"/tmp/hf_tpu_chip_train_{os.getpid()}", ga=ga,
                       callbacks=[steps_cb, memory], optim=os.environ.get("OPTIM", "adamw_torch"), bf16=autocast)  # fmt: skip
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    warm = steps_cb.steps[2:]
    step_s = statistics.median(s["seconds"] for s in warm) if warm else None
    flops = train_flops(config, batch * ga, seq, lora=lora)
    after = {k: sum(s[k] for s in warm) for k in ("graphs", "tpu_cache_misses")}
    rec(step="train", model=name, layers=layers, batch=batch, seq=seq, ga=ga, lora=lora,
        compiled=os.environ.get("COMPILE", "1") == "1", optim=os.environ.get("OPTIM", "adamw_torch"), bf16=autocast,
        step_s=step_s,
        tokens_per_s=batch * ga * seq / step_s if step_s else None, flops=flops, matmul_rate=rate,
        fraction_of_matmul_rate=flops["total"] / step_s / rate if step_s else None, compiles_after_step_2=after,
        steps=steps_cb.steps, memory_after_step_2=memory.values, train_s=total)  # fmt: skip
    del trainer, model
    curve = int(os.environ.get("CURVE_STEPS", "20"))
    if curve:
        _loss_curve_against_cpu(curve)


def _loss_curve_against_cpu(steps: int) -> None:
    """The smoke Llama (float32) trained ``steps`` Trainer steps on the chip and on the CPU from the same weights on
    the same batches: both loss curves and their largest difference (matmuls at 'highest' precision on the chip)."""
    import copy

    import torch
    import transformers

    config_class, fields = SMOKE_MODEL
    config = getattr(transformers, config_class)(**fields)
    config.use_cache = False
    torch.manual_seed(0)
    cpu_model = transformers.AutoModelForCausalLM.from_config(config).float()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    rows = _rows(steps * 4, 32, config.vocab_size - 8, seed=1)
    torch.set_float32_matmul_precision("highest")
    curves = {}
    for where, model in (("tpu", tpu_model), ("cpu", cpu_model)):
        cb = _step_callback()
        trainer = _trainer(model, rows, 32, 4, steps, f"/tmp/hf_tpu_chip_curve_{where}_{os.getpid()}",
                           use_cpu=where == "cpu", log_every=1, bf16=False, callbacks=[cb])  # fmt: skip
        trainer.train()
        curves[where] = [s.get("loss") for s in cb.steps]
    torch.set_float32_matmul_precision("medium")
    diff = max(abs(a - b) for a, b in zip(curves["tpu"], curves["cpu"], strict=True))
    rec(step="loss_curve_vs_cpu", steps=steps, max_abs_diff=diff, tpu=curves["tpu"], cpu=curves["cpu"])


STAGES = {
    "basics": stage_basics,
    "dispatch": stage_dispatch,
    "kv_write": stage_kv_write,
    "jaxop": stage_jaxop,
    "generate": stage_generate,
    "experts": stage_experts,
    "llama_decode": stage_llama_decode,
    "lean": stage_lean,
    "numerics": stage_numerics,
    "selftest": stage_selftest,
    "moe_diag": stage_moe_diag,
    "tier": stage_tier,
    "prefill": stage_prefill,
    "serve": stage_serve,
    "denoiser": stage_denoiser,
    "train": stage_train,
}


def parse_stage(spec: str) -> tuple[str, int, dict[str, str]]:
    """``name[:seconds[:ENV=V,ENV=V]]`` -> (name, seconds, env).

    Raises:
        ValueError: an unknown stage or a malformed spec.
    """
    name, _, rest = spec.partition(":")
    seconds, _, envs = rest.partition(":")
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r} in {spec!r}; the stages: {', '.join(STAGES)}")
    env = {}
    for item in filter(None, envs.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{spec!r}: {item!r} is not ENV=VALUE")
        env[key] = value
    return name, int(seconds or 120), env


# ---------------------------------------------------------------------------------------------------------------
# The lent chip: pack here, install there
# ---------------------------------------------------------------------------------------------------------------


def torch_tpu_members(site: Path) -> list[str]:
    """The paths of torch_tpu (and its dist-info) under ``site`` that torch 2.13 needs: the builds for other torch
    versions and the byte-code caches stay behind."""
    names = []
    for top in ("torch_tpu", "torch_tpu-0.2.0.dist-info"):
        for path in sorted((site / top).rglob("*")):
            rel = path.relative_to(site).as_posix()
            if path.is_dir() or "__pycache__" in rel or any(tag in rel for tag in OTHER_TAGS):
                continue
            names.append(rel)
    return names


def pack(dest: Path, venv: Path) -> None:
    """Write ``dest/tt`` (torch_tpu, small wheels), ``dest/lt1`` .. ``lt3`` (libtpu's wheel in three parts; the
    kernels wheel beside the first) and ``dest/ex`` (EXTRA_WHEELS and transformers' wheel)."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    for sub in ("tt", "lt1", "ex"):
        (dest / sub).mkdir(parents=True, exist_ok=True)
    members = torch_tpu_members(site)
    listing = dest / "tt" / "members.txt"
    listing.write_text("\n".join(members) + "\n")
    subprocess.run(f"tar cf - -C {site} -T {listing} | xz -T2 -9 > {dest / 'tt' / 'torch_tpu.tar.xz'}", shell=True,
                   check=True)  # fmt: skip
    # The kernels wheel travels beside libtpu's first half and transformers' wheel with the extras: with torch_tpu
    # (41 MB) and the working tree (11 MB) either would take the tt call past the tool's 64 MiB (it did on 2026-12-07).
    extras = [n for n in EXTRA_WHEELS if _installed_version(site, n, missing_ok=True)]
    for sub, names in (("tt", SMALL_WHEELS), ("lt1", ("kernels",)), ("ex", (*extras, "transformers"))):
        wheels = [f"{n}=={_installed_version(site, n)}" for n in names]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.11", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        "--platform", "manylinux_2_26_x86_64", "--platform", "manylinux2014_x86_64",
                        "-d", str(dest / sub), *wheels], check=True)  # fmt: skip
    # libtpu travels as its PyPI wheel (zip-compressed already: no xz pass over its 484 MB, which took many minutes on a
    # loaded 2-core host) in three parts of about 46 MB, one per call (lt1, lt2, lt3)
    version = _installed_version(site, "libtpu")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.11", "--implementation", "cp", "--platform", "manylinux_2_31_x86_64",
                    "-d", str(dest), f"libtpu=={version}"], check=True)  # fmt: skip
    wheel = next(dest.glob(f"libtpu-{version}-*.whl"))
    data = wheel.read_bytes()
    size = -(-len(data) // LIBTPU_PARTS)
    for i in range(LIBTPU_PARTS):
        sub = dest / f"lt{i + 1}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{wheel.name}.part{i}").write_bytes(data[i * size : (i + 1) * size])
    wheel.unlink()


def _installed_version(site: Path, name: str, missing_ok: bool = False) -> str:
    key = name.replace("-", "_").lower()
    for info in site.glob("*.dist-info"):
        dist, _, version = info.name[: -len(".dist-info")].partition("-")
        if dist.lower() == key:
            return version
    if missing_ok:
        return ""
    raise FileNotFoundError(f"{name} is not installed in {site}: install it there first")


def _pip(*args: str) -> None:
    env = {**os.environ, "PIP_CONFIG_FILE": "/dev/null"}
    subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "-q", "--no-cache-dir", "--no-compile",
                    *args], check=True, env=env)  # fmt: skip


def install(folder: Path) -> None:
    """On the lent chip: install what ``pack`` wrote, one folder per call (``tt``, then ``lt1``, ``lt2``, ``lt3``, and
    ``ex`` where needed)."""
    site, tf, lib = CHIP_HOME / "site", CHIP_HOME / "transformers", CHIP_HOME / "libtpu"
    for d in (site, tf, lib):
        d.mkdir(parents=True, exist_ok=True)
    if (folder / "torch_tpu.tar.xz").exists():
        _pip("--only-binary=:all:", "--index-url", "file:///opt/pypi/simple", "--find-links", "/opt/wheels",
             "--target", str(site), f"torch=={TORCH_VERSION}")  # fmt: skip
        subprocess.run(["tar", "xJf", str(folder / "torch_tpu.tar.xz"), "-C", str(site)], check=True)
        small = [str(p) for n in SMALL_WHEELS for p in folder.glob(f"{n}-*.whl")]
        _pip("--no-index", "--no-deps", "--target", str(site), *small)
        _pip("--only-binary=:all:", "--index-url", "file:///opt/pypi/simple", "--no-deps", "--target", str(site),
             "absl-py")  # torch_tpu's logging; on the machine's index  # fmt: skip
        wheels = CHIP_HOME / "wheels"  # the ex folder's wheels (huggingface_hub 2.4: the index has 2.0)
        # the version hf_tpu was tested with (it travels in ex); its needs from the index and the ex folder's wheels
        wheel = next(folder.glob("transformers-*.whl"), None) or next(wheels.glob("transformers-*.whl"))
        links = ["--find-links", str(wheels)] if wheels.is_dir() else []
        _pip("--only-binary=:all:", "--index-url", "file:///opt/pypi/simple", *links, "--target", str(tf), str(wheel))
    if folder.name == "ex":  # (transformers' wheel is installed with its needs by the tt folder's call)
        extras = [str(p) for p in sorted(folder.glob("*.whl")) if not p.name.startswith("transformers-")]
        _pip("--no-index", "--no-deps", "--target", str(tf), *extras)
        (CHIP_HOME / "wheels").mkdir(parents=True, exist_ok=True)
        for wheel in folder.glob("*.whl"):
            (CHIP_HOME / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
    for wheel in folder.glob("kernels-*.whl"):
        # kernels (hf_tpu's measured experts choice takes the Hub kernel's forms only where it is importable, as on a
        # TPU VM with hf-tpu[tpu]); not on the machine's index, its needs are transformers' (huggingface_hub, pyyaml).
        # transformers 5.25 requires it: the tt folder's install finds it among the wheels (install lt1 before tt)
        _pip("--no-index", "--no-deps", "--target", str(tf), str(wheel))
        (CHIP_HOME / "wheels").mkdir(parents=True, exist_ok=True)
        (CHIP_HOME / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
    for part in sorted(folder.glob("libtpu-*.whl.part*")):
        (lib / part.name).write_bytes(part.read_bytes())
    parts = sorted(lib.glob("libtpu-*.whl.part*"), key=lambda p: int(p.name.rsplit("part", 1)[1]))
    if len(parts) == LIBTPU_PARTS:
        wheel = lib / parts[0].name.rsplit(".part", 1)[0]
        with open(wheel, "wb") as f:
            for part in parts:
                f.write(part.read_bytes())
                part.unlink()
        import zipfile

        with zipfile.ZipFile(wheel) as z:
            z.extractall(lib)
        wheel.unlink()
    print(json.dumps({"site": len(list(site.iterdir())), "libtpu": sorted(p.name for p in lib.iterdir())}))


def stage_env(name: str = "") -> dict[str, str]:
    """The environment a stage process runs in: on the lent chip, libtpu 0.0.52 first, torch and torch_tpu after the
    machine's own folders, JAX kept off the chip (torch_tpu holds it); on a TPU VM, unchanged. The ``lean`` stage
    runs JAX alone on the chip, with the machine's own libtpu."""
    env = dict(os.environ)
    # the lent chip's JAX comes through it (this checkout's root left out: it goes last, once; hf-tpu launch adds it to
    # its own process's PYTHONPATH for its workers, so a process that launched ranks has it there already)
    current = [p for p in env.get("PYTHONPATH", "").split(":") if p and p != str(ROOT)]
    paths = [*current, str(ROOT)]
    if (CHIP_HOME / "site").is_dir() and name != "lean":
        paths = [str(CHIP_HOME / "libtpu"), *current, str(CHIP_HOME / "site"), str(CHIP_HOME / "transformers"),
                 str(ROOT)]  # fmt: skip
        env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ":".join(paths)
    return env


def run(out: Path, stages: list[str], deadline: float) -> int:
    """Each stage in a process of its own, with its own timeout and the time left; the records in out/."""
    out.mkdir(parents=True, exist_ok=True)
    parsed = [parse_stage(s) for s in stages]
    start = time.monotonic()
    failures = 0
    for i, (name, seconds, extra) in enumerate(parsed):
        left = deadline - (time.monotonic() - start)
        if left < 20:
            print(f"skipped {stages[i]}: no time left", flush=True)
            continue
        env = {**stage_env(name), **extra}
        log = out / f"{i:02d}-{name}.log"
        with open(log, "w") as f:
            try:
                code = subprocess.run([sys.executable, __file__, "_stage", name, str(out)], env=env, stdout=f,
                                      stderr=subprocess.STDOUT, timeout=min(seconds, left)).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                code = "timeout"
        failures += code != 0
        print(f"{stages[i]}: {code} ({time.monotonic() - start:.0f} s)", flush=True)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run stages on this machine's chip")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stages", nargs="+", default=list(DEFAULT_STAGES))
    p.add_argument("--deadline", type=float, default=580.0, help="seconds for all stages together")
    p = sub.add_parser("pack", help="write the folders that carry torch_tpu and libtpu to the lent chip")
    p.add_argument("dest", type=Path)
    p.add_argument("--venv", type=Path, required=True)
    p = sub.add_parser("install", help="on the lent chip: install one folder pack wrote")
    p.add_argument("folder", type=Path)
    p = sub.add_parser("_stage")
    p.add_argument("name")
    p.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args.out, args.stages, args.deadline)
    if args.command == "pack":
        pack(args.dest, args.venv)
        return 0
    if args.command == "install":
        install(args.folder)
        return 0
    global _OUT, _STAGE
    _OUT, _STAGE = args.out, args.name
    try:
        STAGES[args.name]()
    except Exception as exc:  # noqa: BLE001 - recorded, with where
        rec(step="failed", error=repr(exc)[:2000], traceback=traceback.format_exc()[-4000:])
        return 1
    rec(step="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
