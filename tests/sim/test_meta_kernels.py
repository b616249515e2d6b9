"""torch_tpu's ``_grouped_mm`` meta kernel mirrored on the simulator: traced graphs take what a TPU takes.

transformers' default experts implementation in hf_tpu's compiled generate loop: tests/transformers/test_moe.py.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import hf_tpu
import hf_tpu.sim
from hf_tpu.sim import _meta_kernels


def _grouped_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(M, K) rows grouped by ``offs`` times (G, K, N): one float64 matmul per group, on the CPU."""
    out = torch.zeros(a.shape[0], b.shape[-1], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end].double() @ b[g].double()
        start = end
    return out


def _moe_inputs(dtype=torch.float32, k=6, n=5):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, k, generator=g).to(dtype)
    b = torch.randn(3, n, k, generator=g).to(dtype).transpose(-2, -1)  # (G, K, N) as transformers passes it
    return a, b, torch.tensor([2, 2, 7], dtype=torch.int32)


def _fake(mode, t, device):
    return mode.from_tensor(t, static_shapes=True) if device == "cpu" else mode.from_tensor(t.to(device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tpu_fake_tensors_take_what_torch_tpu_takes_and_cpu_keeps_upstream(dtype):
    a, b, offs = _moe_inputs(dtype)  # K = 6, N = 5: strides not multiples of 16 bytes
    mode = FakeTensorMode()
    fa, fb, fo = (mode.from_tensor(t.to("tpu")) for t in (a, b, offs.long()))
    with mode:
        out = torch._grouped_mm(fa, fb, offs=fo)
    assert (out.shape, out.dtype, out.device.type, out.is_contiguous()) == ((7, 5), dtype, "tpu", True)
    ca, cb, co = (mode.from_tensor(t) for t in (a, b, offs))
    with mode, pytest.raises(RuntimeError, match="Expected inputs of BF16 type|multiple of 16 bytes"):
        torch._grouped_mm(ca, cb, offs=co)  # upstream's rules on other devices


def test_refusals_are_torch_tpus_in_eager_and_in_compiled_graphs():
    a, b, offs = (t.to("tpu") for t in _moe_inputs())
    compiled = torch.compile(lambda x, y, o, bias: torch._grouped_mm(x, y, offs=o, bias=bias), fullgraph=True)
    eager = lambda *args: torch._grouped_mm(*args[:3], bias=args[3])  # noqa: E731
    # dynamo wraps what the meta kernel raised in its own exception, with the message kept
    for fn, not_implemented in ((eager, NotImplementedError), (compiled, Exception)):
        with pytest.raises(not_implemented, match="expected bias to be undefined"):
            fn(a, b, offs, torch.zeros(3, 5, device="tpu"))
        with pytest.raises(Exception, match="expected self to be float32, float16, or bfloat16, got float64"):
            fn(a.double(), b.double(), offs, None)
        with pytest.raises(Exception, match="expected offs batch size to match mat2 batch size, got 2 and 3"):
            fn(a, b, offs[:2], None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_grouped_mm_on_tpu_tensors_equals_cpu(dtype):
    a, b, offs = _moe_inputs(dtype)
    expected = _grouped_reference(a, b, offs)
    fn = torch.compile(lambda x, y, o: torch.nn.functional.grouped_mm(x, y, offs=o) * 2, fullgraph=True)
    with hf_tpu.sim.stats() as s:
        got = fn(a.to("tpu"), b.to("tpu"), offs.long().to("tpu"))  # unaligned strides, int64 offsets: as on a TPU
    assert s.compiles == 1 and got.device.type == "tpu" and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu().double(), 2 * expected, rtol=tol, atol=tol)
    # aligned inputs run the CPU kernel itself: bit for bit the CPU's result
    a8, b8, offs8 = _moe_inputs(dtype, k=8, n=8)
    on_cpu = torch.nn.functional.grouped_mm(a8, b8, offs=offs8) * 2  # eager: compiled, upstream's meta refuses
    assert torch.equal(fn(a8.to("tpu"), b8.to("tpu"), offs8.to("tpu")).cpu(), on_cpu)


def test_disable_removes_the_mirror_and_enable_restores_it():
    a, b, offs = _moe_inputs()
    mode = FakeTensorMode()
    fa, fb, fo = (mode.from_tensor(t.to("tpu")) for t in (a, b, offs))
    assert _meta_kernels.installed()
    hf_tpu.disable()
    try:
        assert not _meta_kernels.installed()
        with mode, pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
            torch._grouped_mm(fa, fb, offs=fo)  # upstream's meta again, for tpu tensors too
    finally:
        hf_tpu.sim.enable()
    assert _meta_kernels.installed()
    with mode:
        assert torch._grouped_mm(fa, fb, offs=fo).shape == (7, 5)
