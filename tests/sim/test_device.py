"""Device semantics of the simulated tpu: placement, views, in-place ops, out=, resize_, autograd, errors."""

import io

import pytest
import torch

import hf_tpu.sim
from hf_tpu import runtime


def test_runtime_reports_simulated():
    info = runtime.detect()
    assert info.mode == "simulated" and info.device_count == 1 and info.generation == "v6e"
    assert info.hbm_bytes == torch.tpu.get_device_properties(0).total_memory == 32 * 1024**3
    assert torch.accelerator.current_accelerator().type == "tpu"
    assert torch.accelerator.is_available() and torch.accelerator.device_count() == 1
    assert torch.accelerator.current_device_index() == 0
    assert hasattr(torch.backends, "tpu")
    assert "v6e" in torch.tpu.get_device_name()


def test_enable_is_idempotent_and_reconfigures():
    hf_tpu.sim.enable()
    hf_tpu.sim.enable(generation="v5e", hbm=2 * 1024**2)
    assert runtime.detect().hbm_bytes == 2 * 1024**2 and runtime.detect().generation == "v5e"
    assert torch.tpu.get_device_properties().total_memory == 2 * 1024**2
    with pytest.raises(ValueError, match="unknown TPU generation"):
        hf_tpu.sim.enable(generation="v99")


def test_enabling_again_leaves_dynamos_skip_list_as_it_was():
    from torch._dynamo import trace_rules

    hf_tpu.sim.enable()
    skipped = list(trace_rules.SKIP_DIRS)
    for _ in range(3):  # test fixtures enable the simulator before every test
        hf_tpu.sim.enable()
    assert trace_rules.SKIP_DIRS == skipped
    assert any("hf_tpu/sim/_ops" in d for d in skipped)  # dynamo still stays out of the simulator's kernels


def test_round_trip_and_compute_match_cpu():
    x = torch.randn(4, 5)
    t = x.to("tpu")
    assert t.device == torch.device("tpu:0") and t.is_tpu
    y = torch.nn.functional.gelu(t @ t.T + 1).softmax(-1)
    torch.testing.assert_close(y.cpu(), torch.nn.functional.gelu(x @ x.T + 1).softmax(-1))


def test_only_tpu0_exists():
    with pytest.raises(RuntimeError, match="one device"):
        torch.ones(2).to("tpu:1")


def test_views_alias_and_inplace_returns_same_tensor():
    t = torch.arange(12.0).reshape(3, 4).to("tpu")
    v = t[:, 1:3]
    assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    r = v.mul_(0)
    assert r is v
    expected = torch.arange(12.0).reshape(3, 4)
    expected[:, 1:3] = 0
    assert torch.equal(t.cpu(), expected)
    t.T[0].fill_(7)
    expected.T[0].fill_(7)
    assert torch.equal(t.cpu(), expected)


def test_out_and_resize():
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    out = torch.empty(0, device="tpu")
    r = torch.matmul(a.to("tpu"), b.to("tpu"), out=out)
    assert r is out and out.shape == (3, 3)
    torch.testing.assert_close(out.cpu(), a @ b)
    out.resize_(20)
    assert out.shape == (20,)
    out.fill_(1)
    assert out.cpu().sum().item() == 20


def test_zero_size_and_offsets():
    t = torch.empty(0, 3, device="tpu")
    assert t.cpu().shape == (0, 3)
    u = torch.arange(10.0, device="tpu")[7:]
    assert u.storage_offset() == 7 and u.cpu().tolist() == [7.0, 8.0, 9.0]
    assert torch.cat([t.flatten(), u]).cpu().tolist() == [7.0, 8.0, 9.0]


def test_bmm_batched_and_dtypes():
    a, b = torch.randn(4, 3, 5), torch.randn(4, 5, 2)
    torch.testing.assert_close(torch.bmm(a.to("tpu"), b.to("tpu")).cpu(), torch.bmm(a, b))
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(8, 8).to(dtype)
        torch.testing.assert_close((x.to("tpu") @ x.to("tpu")).cpu(), x @ x)


def test_conv2d_forward_and_backward():
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    conv_t = torch.nn.Conv2d(3, 4, 3, padding=1).to("tpu")
    conv_t.load_state_dict(conv.state_dict())
    xt = x.detach().to("tpu").requires_grad_()
    conv(x).square().sum().backward()
    conv_t(xt).square().sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), x.grad)
    torch.testing.assert_close(conv_t.weight.grad.cpu(), conv.weight.grad)
    torch.testing.assert_close(conv_t.bias.grad.cpu(), conv.bias.grad)


def test_autograd_linear():
    lin = torch.nn.Linear(4, 3)
    lin_t = torch.nn.Linear(4, 3)
    lin_t.load_state_dict(lin.state_dict())
    lin_t.to("tpu")
    x = torch.randn(5, 4)
    lin(x).tanh().sum().backward()
    lin_t(x.to("tpu")).tanh().sum().backward()
    assert lin_t.weight.grad.device.type == "tpu"
    torch.testing.assert_close(lin_t.weight.grad.cpu(), lin.weight.grad)


def test_mixing_devices_raises():
    t = torch.ones(3, device="tpu")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        t + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.mm(torch.ones(2, 3), torch.ones(3, 2, device="tpu"))
    assert (t + torch.tensor(2.0)).cpu().tolist() == [3.0, 3.0, 3.0]  # 0-dim CPU scalars are allowed


def test_rng_seeding_reproducible():
    torch.manual_seed(123)
    a = torch.randn(5, device="tpu").cpu()
    d1 = torch.nn.functional.dropout(torch.ones(100, device="tpu"), 0.5).cpu()
    torch.manual_seed(123)
    b = torch.randn(5, device="tpu").cpu()
    d2 = torch.nn.functional.dropout(torch.ones(100, device="tpu"), 0.5).cpu()
    assert torch.equal(a, b) and torch.equal(d1, d2)
    assert not torch.equal(d1, torch.ones(100))
    with torch.random.fork_rng(device_type="tpu"):  # torch saves and restores the device's RNG through torch.tpu
        c = torch.rand(3, device="tpu").cpu()
    assert torch.equal(c, torch.rand(3, device="tpu").cpu())


def test_model_to_tpu_and_back():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    x = torch.randn(2, 4)
    ref = m(x)
    m.to("tpu")
    assert all(p.device.type == "tpu" for p in m.parameters())
    torch.testing.assert_close(m(x.to("tpu")).cpu(), ref)
    m.cpu()
    torch.testing.assert_close(m(x), ref)


def test_host_view_shares_memory():
    t = torch.zeros(2, 3, device="tpu")
    with hf_tpu.sim.stats() as s:
        hv = hf_tpu.sim.host_view(t)
        hv[0, 1] = 5.0
    assert hv.device.type == "cpu" and s.d2h_copies == 0
    assert t.cpu()[0, 1].item() == 5.0
    assert hf_tpu.sim.is_enabled() and hf_tpu.sim.is_sim_tensor(t) and not hf_tpu.sim.is_sim_tensor(hv)


def test_op_without_cpu_kernel_raises_not_implemented():
    lib = torch.library.Library("hf_tpu_sim_test", "DEF")
    lib.define("cuda_only(Tensor x) -> Tensor")
    lib.impl("cuda_only", lambda x: x, "CUDA")
    t = torch.ones(3, device="tpu")
    with pytest.raises(NotImplementedError, match="cuda_only"):
        torch.ops.hf_tpu_sim_test.cuda_only(t)


def test_fft_matches_cpu():
    x = torch.randn(4, 8)
    torch.testing.assert_close(torch.fft.rfft(x.to("tpu")).cpu(), torch.fft.rfft(x))
    torch.testing.assert_close(torch.fft.fft2(x.to("tpu")).cpu(), torch.fft.fft2(x))


def test_torch_load_map_location_tpu():
    buf = io.BytesIO()
    w = torch.arange(6.0).view(2, 3)
    torch.save({"w": w, "tail": w.flatten()[2:]}, buf)
    buf.seek(0)
    loaded = torch.load(buf, map_location="tpu")
    assert loaded["w"].device.type == "tpu" and torch.equal(loaded["w"].cpu(), w)
    assert torch.equal(loaded["tail"].cpu(), w.flatten()[2:])


def test_tensor_constructor_under_fake_mode():
    # torch.compile traces with FakeTensorMode active; torch.tensor(..., device="tpu") inside must work
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        t = torch.tensor([1.0, 2.0], device="tpu")
    assert t.device.type == "tpu" and t.shape == (2,)


def test_sdpa_runs_fused_and_matches_cpu_with_grads():
    import torch.nn.functional as F

    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    mask = torch.randn(16, 16)
    qt, kt, vt = (t.detach().to("tpu").requires_grad_() for t in (q, k, v))
    mask_t = mask.to("tpu")
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with hf_tpu.sim.stats() as s:
        out_t = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask_t)
    assert s.ops == 1  # one fused device op, as on torch_tpu, not the math decomposition
    torch.testing.assert_close(out_t.cpu(), out)
    g = torch.randn_like(out)
    out.backward(g)
    out_t.backward(g.to("tpu"))
    for a, b in zip((q, k, v), (qt, kt, vt), strict=True):
        assert b.grad.device.type == "tpu"
        torch.testing.assert_close(b.grad.cpu(), a.grad)


def test_sdpa_dropout_uses_device_generator():
    import torch.nn.functional as F

    q = torch.randn(1, 2, 8, 8, device="tpu")
    v = torch.eye(8).expand(1, 2, 8, 8).to("tpu")  # the output is then the (dropped-out) attention weights
    torch.manual_seed(3)
    a = F.scaled_dot_product_attention(q, q, v, dropout_p=0.5).cpu()
    torch.manual_seed(3)
    b = F.scaled_dot_product_attention(q, q, v, dropout_p=0.5).cpu()
    assert torch.equal(a, b)  # the seed decides the mask
    torch.manual_seed(4)
    assert not torch.equal(a, F.scaled_dot_product_attention(q, q, v, dropout_p=0.5).cpu())
    # dropout is applied: each weight of the CPU's softmax is either dropped or scaled by 1 / (1 - p)
    weights = torch.softmax(q.cpu() @ q.cpu().transpose(-1, -2) / 8**0.5, dim=-1)
    kept = a != 0
    torch.testing.assert_close(a[kept], 2 * weights[kept])
    assert 0.25 < kept.float().mean() < 0.75, kept.float().mean()  # about half of 128 weights kept


def test_autocast_tpu_follows_cpu_policy():
    a, b = torch.randn(4, 8), torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.linear(a, b).float().softmax(-1)
    with torch.autocast("tpu"):  # bfloat16 by default, as on TPU
        out = torch.nn.functional.linear(a.to("tpu"), b.to("tpu"))
        probs = out.float().softmax(-1)
    assert out.dtype == torch.bfloat16 and probs.dtype == torch.float32
    torch.testing.assert_close(probs.cpu(), ref)
    lin = torch.nn.Linear(8, 3).to("tpu")
    with torch.autocast("tpu"):
        loss = lin(a.to("tpu")).float().square().mean()
    loss.backward()
    assert lin.weight.grad.dtype == torch.float32 and lin.weight.grad.device.type == "tpu"


def test_untyped_storage_on_tpu_does_not_crash():
    s = torch.UntypedStorage(16, device="tpu")
    assert s.device.type == "tpu" and s.nbytes() == 16
    t = torch.empty(0, device="tpu").set_(s, 0, (4,), (1,))
    t.fill_(2.0)
    assert t.cpu().tolist() == [2.0] * 4
