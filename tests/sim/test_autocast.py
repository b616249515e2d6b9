"""``torch.autocast("tpu")`` on the simulated device: the policy casts, autograd through it, same numbers as CPU."""

import torch


def test_autocast_policy_and_default_dtype():
    x = torch.randn(4, 8)
    w = torch.randn(8, 3)
    xt, wt = x.to("tpu"), w.to("tpu")
    with torch.autocast("tpu"):
        assert torch.get_autocast_dtype("tpu") == torch.bfloat16
        mm = xt @ wt
        assert mm.dtype == torch.bfloat16 and mm.device.type == "tpu"
        assert torch.nn.functional.linear(xt, wt.T).dtype == torch.bfloat16
        assert xt.exp().dtype == torch.float32  # outside the policy: untouched
        assert torch.cat([xt, xt.bfloat16()]).dtype == torch.float32  # promoted to the widest input
        loss = torch.nn.functional.cross_entropy(mm, torch.tensor([0, 1, 2, 0], device="tpu"))
        assert loss.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = x @ w
    torch.testing.assert_close(mm.cpu(), ref)
    assert (xt @ wt).dtype == torch.float32  # off again after the block


def test_autocast_backward_reaches_float32_leaves():
    w = torch.randn(8, 3, requires_grad=True)
    wt = w.detach().to("tpu").requires_grad_()
    x = torch.randn(4, 8)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        (x.to("tpu") @ wt).float().square().sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (x @ w).float().square().sum().backward()
    assert wt.grad.dtype == torch.float32 and wt.grad.device.type == "tpu"
    torch.testing.assert_close(wt.grad.cpu(), w.grad)
