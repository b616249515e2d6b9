"""float32 matmul precision: torch_tpu 0.2.0's ``torch.set/get_float32_matmul_precision`` and ``torch.tpu.precision``
on the simulator, and its emulation of the TPU's reduced-precision matmuls, convolutions and attention (on by default:
the simulator computes as a chip does). The suite runs at ``'highest'`` (tests/conftest.py); these tests at torch_tpu's
default, ``'medium'``, unless they say otherwise."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import hf_tpu
import hf_tpu.sim
from hf_tpu.numerics import CHIP_MATMUL_ERROR, max_error

pytestmark = pytest.mark.tpu_precision("medium")

N = 256  # the chip's figures are for a 256x256 float32 matmul of standard normals (hf_tpu.numerics)


def _bf16(t):
    return t.to(torch.bfloat16).float()


def test_api_mirrors_torch_tpu():
    assert torch.get_float32_matmul_precision() == "medium"  # torch_tpu's initial global precision is DEFAULT
    for value in ("high", "highest", "medium"):
        torch.set_float32_matmul_precision(value)
        assert torch.get_float32_matmul_precision() == value
    with pytest.raises(ValueError, match="expected to be one of 'highest', 'high', or 'medium', got 'low'"):
        torch.set_float32_matmul_precision("low")
    assert torch.get_float32_matmul_precision() == "medium"
    assert torch._C._get_float32_matmul_precision() == "highest"  # like torch_tpu: torch's own CPU setting untouched
    assert [p.name for p in torch.tpu.Precision] == ["DEFAULT", "HIGH", "HIGHEST"]
    with pytest.raises(ValueError, match="PrecisionConfig.DEFAULT"):
        with torch.tpu.precision("highest"):
            pass


def test_disable_restores_torchs_functions():
    hf_tpu.disable()
    try:
        torch.set_float32_matmul_precision("high")  # torch's own: accepts and sets its CPU/CUDA flag
        assert torch._C._get_float32_matmul_precision() == "high"
        torch.set_float32_matmul_precision("highest")
    finally:
        hf_tpu.sim.enable()
    with pytest.raises(ValueError):
        torch.set_float32_matmul_precision("low")


def test_without_emulation_float32_matmuls_equal_the_cpu():
    hf_tpu.sim.enable(emulate_precision=False)  # a user's opt-out: float32 as the CPU computes it, at every setting
    a, b = torch.randn(32, 64), torch.randn(64, 16)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    assert torch.get_float32_matmul_precision() == "medium"
    assert torch.equal((a.to("tpu") @ b.to("tpu")).cpu(), a @ b)
    got = F.scaled_dot_product_attention(q.to("tpu"), k.to("tpu"), v.to("tpu"), is_causal=True).cpu()
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_emulated_medium_is_one_bf16_pass_and_high_is_bf16x3():
    torch.manual_seed(0)
    a, b = torch.randn(32, 64, dtype=torch.float64), torch.randn(64, 16, dtype=torch.float64)
    exact = a @ b
    a32, b32 = a.float(), b.float()
    ta, tb = a32.to("tpu"), b32.to("tpu")
    medium = (ta @ tb).cpu()
    torch.testing.assert_close(medium, _bf16(a32) @ _bf16(b32))  # inputs rounded to bf16, float32 accumulation
    torch.set_float32_matmul_precision("high")
    high = (ta @ tb).cpu()
    a_hi, b_hi = _bf16(a32), _bf16(b32)
    a_lo, b_lo = _bf16(a32 - a_hi), _bf16(b32 - b_hi)
    torch.testing.assert_close(high, a_hi @ b_hi + (a_hi @ b_lo + a_lo @ b_hi), rtol=1e-6, atol=1e-6)
    torch.set_float32_matmul_precision("highest")
    highest = (ta @ tb).cpu()
    assert torch.equal(highest, a32 @ b32)
    err = {name: (t.double() - exact).abs().max().item() for name, t in [("m", medium), ("h", high), ("x", highest)]}
    assert err["m"] > 10 * err["h"] and err["h"] >= err["x"] / 4 and err["m"] > 1e-3


def test_emulation_covers_linear_bmm_addmm_and_convolution():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    ref = torch.nn.functional.linear(_bf16(x), _bf16(lin.weight), lin.bias)  # bias added in float32
    torch.testing.assert_close(lin.to("tpu")(x.to("tpu")).cpu(), ref)
    p, q = torch.randn(3, 4, 5), torch.randn(3, 5, 2)
    torch.testing.assert_close(torch.bmm(p.to("tpu"), q.to("tpu")).cpu(), torch.bmm(_bf16(p), _bf16(q)))
    conv = torch.nn.Conv2d(3, 4, 3)
    img = torch.randn(1, 3, 8, 8)
    ref = torch.nn.functional.conv2d(_bf16(img), _bf16(conv.weight), conv.bias)
    torch.testing.assert_close(conv.to("tpu")(img.to("tpu")).cpu(), ref)
    with torch.tpu.precision(torch.tpu.Precision.HIGHEST):  # a local override, as torch_tpu's context manager
        assert torch.equal(torch.bmm(p.to("tpu"), q.to("tpu")).cpu(), torch.bmm(p, q))


def test_emulation_leaves_bf16_and_cpu_tensors_alone():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    assert torch.equal((a.to("tpu").bfloat16() @ b.to("tpu").bfloat16()).cpu(), a.bfloat16() @ b.bfloat16())
    assert not torch.equal(a @ b, _bf16(a) @ _bf16(b))  # the CPU computes in float32, emulation or not


# -- the chip's figures (issue #67): at the default precision a tpu matmul errs as a v5e's, at 'highest' as float32 --


def _linear(g):
    lin = torch.nn.Linear(N, N, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, N, generator=g))
    return lambda x: lin.to(device=x.device, dtype=x.dtype)(x), (torch.randn(N, N, generator=g),)


def _compiled(g):
    fn = torch.compile(lambda x, w: F.gelu(x) + x @ w, backend="tpu")  # a graph of the "tpu" backend around a matmul
    return lambda x, w: fn(x, w) if x.device.type == "tpu" else F.gelu(x) + x @ w, (
        torch.randn(N, N, generator=g), torch.randn(N, N, generator=g))


CASES = {
    "mm": lambda g: (torch.mm, (torch.randn(N, N, generator=g), torch.randn(N, N, generator=g))),
    "linear": _linear,
    "bmm": lambda g: (torch.bmm, (torch.randn(4, N, N, generator=g), torch.randn(4, N, N, generator=g))),
    "conv": lambda g: (F.conv2d, (torch.randn(2, 16, 20, 20, generator=g), torch.randn(N, 16, 4, 4, generator=g))),
    "compiled": _compiled,
}


def _error(case, seed=0):
    """max|tpu - float64| / max|float64| of ``case`` on standard normals (float32 on the device)."""
    fn, args = CASES[case](torch.Generator().manual_seed(seed))
    if case == "compiled":
        torch._dynamo.reset()  # a graph keeps the precision it was compiled at, as on a chip: compile at this one
    with torch.no_grad():
        exact = fn(*(a.double() for a in args))
        return max_error(fn(*(a.to("tpu") for a in args)), exact)


@pytest.mark.parametrize("case", sorted(CASES))
def test_default_precision_errs_as_the_chip_does_and_highest_as_float32(case):
    """A v5e through torch_tpu 0.2.0: 2.0e-3 at its default ('medium'), 9.6e-8 at 'highest' (CHIP_MATMUL_ERROR).
    The simulator's default is within 2x of the chip's figure; at 'highest' it computes float32 (the CPU's)."""
    chip = CHIP_MATMUL_ERROR["medium"]
    assert torch.get_float32_matmul_precision() == "medium"  # torch_tpu's default (a fresh process: test below)
    medium = _error(case)
    assert chip / 2 <= medium <= chip * 2, f"{case}: {medium:.3g} at 'medium', the chip's matmul {chip:.3g}"
    assert 1e-3 <= medium <= 4e-3  # and within 2x of issue #67's figure, 2.0e-3 (the v5e's first measurement)
    torch.set_float32_matmul_precision("highest")
    assert _error(case) <= 1e-6
    with torch.tpu.precision(torch.tpu.Precision.DEFAULT):  # the local override selects it too
        assert _error(case) == medium
    torch.set_float32_matmul_precision("high")
    assert _error(case) < medium / 10


def _reference_attention(q, k, v, mask, scaled_operands=False):
    """The attention a chip computes at 'medium', on the CPU in float32: both products of bfloat16 operands. The
    fused kernel scales the product; torch's math decomposition (a compiled graph's sdpa on the simulator) scales
    ``q`` and ``k`` by the scale's square root before it, so their bfloat16 roundings differ."""
    scale = q.size(-1) ** -0.5
    if scaled_operands:
        q, k = q * scale**0.5, k * scale**0.5
        scale = 1.0
    scores = (_bf16(q) @ _bf16(k).transpose(-2, -1)) * scale
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    return _bf16(p) @ _bf16(v)


@pytest.mark.parametrize("path", ["flash", "math", "compiled"])
def test_attention_runs_its_matmuls_at_the_precision(path):
    """sdpa on a chip multiplies at the float32 matmul precision too, whichever backend torch_tpu picks: the fused
    kernel the simulator runs for FLASH/OVERRIDEABLE, the math decomposition, a compiled graph."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, N, 64, generator=g) for _ in range(3))
    mask = torch.ones(N, N, dtype=torch.bool).tril()
    sdpa = F.scaled_dot_product_attention
    if path == "compiled":
        sdpa = torch.compile(sdpa, backend="tpu")
    backends = [SDPBackend.MATH] if path == "math" else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]

    def on_tpu():
        if path == "compiled":
            torch._dynamo.reset()  # a graph keeps the precision it was compiled at, as on a chip: compile at this one
        with sdpa_kernel(backends):
            return sdpa(q.to("tpu"), k.to("tpu"), v.to("tpu"), is_causal=True).cpu()

    medium = on_tpu()
    reference = _reference_attention(q, k, v, mask, scaled_operands=path == "compiled")
    assert max_error(medium, reference) <= 1e-4  # the bfloat16 products (and not float32's) explain the output
    cpu = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert max_error(medium, exact) > 100 * max_error(cpu, exact)
    torch.set_float32_matmul_precision("highest")
    highest = on_tpu()
    assert max_error(highest, exact) <= 2 * max_error(cpu, exact)
    if path == "flash":
        assert torch.equal(highest, cpu)  # the CPU's own kernel, as before emulation


def test_reduced_attention_trains_and_masks_as_the_cpu():
    """The emulated fused attention's backward, a boolean and a float mask, GQA and a row with every key masked (0,
    as the CPU's kernel gives) at 'medium', against the CPU's float32 kernel at the chip's tolerance."""
    from hf_tpu.numerics import assert_close_to_cpu

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 8, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 8, 16, generator=g, requires_grad=True) for _ in range(2))
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    mask[1, :, 3] = False  # row 3 of the second sequence sees no key
    for m in (mask, torch.zeros(2, 1, 8, 8).masked_fill(~mask, float("-inf"))):
        cpu = F.scaled_dot_product_attention(q, k, v, m, enable_gqa=True)
        tq, tk, tv = (t.detach().to("tpu").requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(tq, tk, tv, m.to("tpu"), enable_gqa=True)
        assert_close_to_cpu(out, cpu, layers=2, what="sdpa")  # two products: q @ k.T, then softmax @ v
        assert torch.equal(out.cpu()[1, :, 3], torch.zeros(4, 16))
        grads = torch.autograd.grad(cpu.sum(), (q, k, v))
        out.sum().backward()
        for t, want in zip((tq, tk, tv), grads, strict=True):
            assert_close_to_cpu(t.grad, want, layers=3, what="sdpa's gradient")  # and the backward's products


_FRESH = """
import json, torch, hf_tpu
a, b = torch.randn(256, 256), torch.randn(256, 256)
err = float(((a.to("tpu") @ b.to("tpu")).cpu().double() - a.double() @ b.double()).abs().max() / (a.double() @ b.double()).abs().max())
print(json.dumps([torch.get_float32_matmul_precision(), err]))
"""


@pytest.mark.parametrize("setting", [None, "highest", "low"])
def test_a_fresh_process_computes_as_a_chip_unless_told(setting):
    """``HF_TPU_SIMULATE=1`` as a user runs it: 'medium' and the chip's error; ``HF_TPU_SIM_MATMUL_PRECISION`` (what
    the suite gives its child processes) starts it elsewhere, and a wrong value is refused with the accepted ones."""
    env = {**os.environ, "HF_TPU_SIMULATE": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    env.pop("HF_TPU_SIM_MATMUL_PRECISION", None)
    if setting:
        env["HF_TPU_SIM_MATMUL_PRECISION"] = setting
    proc = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True)
    if setting == "low":
        assert proc.returncode != 0 and "HF_TPU_SIM_MATMUL_PRECISION='low'" in proc.stderr, proc.stderr[-2000:]
        return
    assert proc.returncode == 0, proc.stderr[-2000:]
    precision, err = json.loads(proc.stdout.strip().splitlines()[-1])
    assert precision == (setting or "medium")
    if setting is None:
        assert CHIP_MATMUL_ERROR["medium"] / 2 <= err <= CHIP_MATMUL_ERROR["medium"] * 2
        assert 1e-3 <= err <= 4e-3  # issue #67's 2.0e-3, within 2x
    else:
        assert err <= 1e-6


@pytest.mark.tpu_precision("medium")
def test_a_compiled_graph_keeps_the_precision_it_was_compiled_at():
    """As on a v5e (run 20): a graph compiled at 'medium' computes one bfloat16 pass after
    set_float32_matmul_precision('highest') and inside torch.tpu.precision(HIGHEST); a graph of a new shape compiled
    at 'highest' is exact, and stays so back at 'medium'. Eager matmuls follow the setting of the moment."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=g), torch.randn(96, 32, generator=g)
    c, d = torch.randn(48, 80, generator=g), torch.randn(80, 24, generator=g)
    one_pass, exact = _bf16(a) @ _bf16(b), a @ b
    f = torch.compile(lambda x, y: x @ y, backend="tpu", fullgraph=True, dynamic=False)
    ad, bd, cd, dd = (t.to("tpu") for t in (a, b, c, d))
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        torch.testing.assert_close(f(ad, bd).cpu(), one_pass)
        torch.set_float32_matmul_precision("highest")
        torch.testing.assert_close(f(ad, bd).cpu(), one_pass)  # compiled at 'medium': stays there
        with torch.tpu.precision(torch.tpu.Precision.HIGHEST):
            torch.testing.assert_close(f(ad, bd).cpu(), one_pass)
        torch.testing.assert_close((ad @ bd).cpu(), exact)  # eager: the setting of the moment
        torch.testing.assert_close(f(cd, dd).cpu(), c @ d)  # a new graph, compiled at 'highest'
        torch.set_float32_matmul_precision("medium")
        torch.testing.assert_close(f(cd, dd).cpu(), c @ d)
    finally:
        torch.set_float32_matmul_precision(before)
