"""float32 matmul precision: torch_tpu 0.2.0's ``torch.set/get_float32_matmul_precision`` and ``torch.tpu.precision``
on the simulator, and the opt-in emulation of the TPU's reduced-precision matmuls and convolutions."""

import pytest
import torch

import hf_tpu
import hf_tpu.sim


@pytest.fixture(autouse=True)
def _restore_precision():
    yield
    torch.set_float32_matmul_precision("medium")
    hf_tpu.sim.enable()


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
    a, b = torch.randn(32, 64), torch.randn(64, 16)
    assert torch.equal((a.to("tpu") @ b.to("tpu")).cpu(), a @ b)


def test_emulated_medium_is_one_bf16_pass_and_high_is_bf16x3():
    hf_tpu.sim.enable(emulate_precision=True)
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
    hf_tpu.sim.enable(emulate_precision=True)
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
    hf_tpu.sim.enable(emulate_precision=True)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    assert torch.equal((a.to("tpu").bfloat16() @ b.to("tpu").bfloat16()).cpu(), a.bfloat16() @ b.bfloat16())
    assert not torch.equal(a @ b, _bf16(a) @ _bf16(b))  # the CPU computes in float32, emulation or not
