"""Run one fixed workload on the simulated tpu and print what it observed as one JSON line.

Usage: HF_TPU_SIM_NATIVE=0|1 python tests/sim/_native_worker.py
test_native.py runs it with the native core off and on: the two lines must be equal (same results against the CPU,
same counters, same errors), so the native core changes the simulator's speed and nothing else.
"""

from __future__ import annotations

import gc
import json
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

import hf_tpu.sim
from hf_tpu.sim import _native

hf_tpu.sim.enable()
torch.manual_seed(0)
out: dict = {"native": _native.status()}


def counted(name, fn):
    """Run ``fn`` inside a stats block; record its counters and whether its result equals the CPU reference."""
    gc.collect()
    with hf_tpu.sim.stats() as s:
        ok = fn()
    gc.collect()
    d = s.as_dict()
    d.pop("peak_bytes")  # peak includes the block's temporaries, which depend on when Python frees them
    out[name] = {"ok": ok, **d}


def error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the error's type and message are what is compared
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return "no error"


x = torch.randn(4, 8)
y = torch.randn(8, 3)
xt, yt = x.to("tpu"), y.to("tpu")


def elementwise():
    r = ((xt * 2 + 1).sin() / (xt.abs() + 0.5)).exp().cpu()
    return torch.allclose(r, ((x * 2 + 1).sin() / (x.abs() + 0.5)).exp())


def matmul_views_and_lists():
    r = torch.cat([xt @ yt, (xt.t()[:3].t() @ yt[:3]).relu()], dim=1).view(-1).reshape(4, 6).cpu()
    ref = torch.cat([x @ y, (x.t()[:3].t() @ y[:3]).relu()], dim=1).view(-1).reshape(4, 6)
    return torch.allclose(r, ref, atol=1e-6)


def factories_and_reductions():
    a = torch.arange(5, device="tpu").sum().cpu().item() + torch.arange(7, device="tpu").sum().cpu().item()
    b = torch.zeros(3, device="tpu") + torch.ones(3, dtype=torch.float64, device="tpu")
    c = xt.sum(dim=0).cpu().tolist(), xt.sum(dim=1).cpu().tolist(), xt.sum(dim=0).cpu().tolist()
    ref = x.sum(dim=0).tolist(), x.sum(dim=1).tolist(), x.sum(dim=0).tolist()
    return a == 31 and b.dtype == torch.float64 and b.cpu().tolist() == [1.0] * 3 and c == ref


def in_place_and_scalars():
    t = xt.clone()
    t.mul_(3).add_(torch.tensor(1.0))
    w = torch.where(t > 0, t, torch.tensor(0.0))
    ref = torch.where(x * 3 + 1 > 0, x * 3 + 1, torch.tensor(0.0))
    return torch.allclose(w.cpu(), ref) and (t.max() * 0).item() == 0.0


def declined_conjugate_matmul():
    # mm takes conjugate views as they are: the native core hands such a call to the op's Python kernel
    z = torch.randn(3, 4, dtype=torch.complex64)
    zt = z.to("tpu").conj()
    r = torch.mm(zt, zt.t()).cpu()
    return torch.allclose(r, torch.mm(z.conj(), z.conj().t()))


def out_resize_and_set():
    # out= into an empty tensor (resized by the kernel), resize_ of a tensor that a view shares, set_ onto another
    a = torch.empty(0, device="tpu")
    torch.mul(xt, 2, out=a)
    ok = a.shape == (4, 8) and torch.equal(a.cpu(), x * 2)
    b = xt.clone()
    v = b[0]
    b.resize_(64)  # reallocates the shared storage; v sees the new memory, as on an accelerator
    ok &= b.shape == (64,) and torch.equal(b[:32].cpu(), x.flatten()) and torch.equal(v.cpu(), x[0])
    c = torch.zeros(3, device="tpu")
    c.set_(yt)
    c.add_(1)
    ok &= torch.equal(yt.cpu(), y + 1) and c.untyped_storage().data_ptr() == yt.untyped_storage().data_ptr()
    yt.sub_(1)
    return bool(ok)


def optimizer_steps():
    torch.manual_seed(1)
    cpu = torch.nn.Linear(8, 4)
    dev = torch.nn.Linear(8, 4)
    dev.load_state_dict(cpu.state_dict())
    dev.to("tpu")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (cpu, dev)]
    for step in range(3):
        for m, opt in zip((cpu, dev), opts):
            for p in m.parameters():
                p.grad = torch.full_like(p, 0.1 * (step + 1))
            opt.step()
            opt.zero_grad()
    return all(torch.allclose(p.cpu(), q, atol=1e-6) for p, q in zip(dev.parameters(), cpu.parameters()))


def memory():
    a = torch.empty(1024, 256, device="tpu")
    b = a[:512]
    del a
    keep = b.numel()
    del b
    return keep == 512 * 256


def _models():
    from hf_tpu.testing import tiny_model

    cpu = tiny_model("llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    dev = tiny_model("llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    dev.load_state_dict(cpu.state_dict())
    return cpu, dev.to("tpu")


CPU_MODEL, DEV_MODEL = _models()


def llama_forward():
    ok = True
    with torch.no_grad():
        for n in (5, 9, 5):
            ids = torch.randint(0, 128, (2, n))
            ok &= torch.allclose(DEV_MODEL(input_ids=ids.to("tpu")).logits.cpu(), CPU_MODEL(input_ids=ids).logits,
                                 atol=1e-5)
    return bool(ok)


def llama_training_step():
    # Not counted like the others: autograd accumulates a gradient in place (add_) when nothing else holds the
    # buffer, and the Python fallback's results are held by their Python objects, so the op mix differs.
    cpu, dev = CPU_MODEL, DEV_MODEL
    ids = torch.randint(0, 128, (2, 7))
    loss = dev(input_ids=ids.to("tpu"), labels=ids.to("tpu")).loss
    loss.backward()
    ref = cpu(input_ids=ids, labels=ids).loss
    ref.backward()
    grads = all(
        torch.allclose(p.grad.cpu(), q.grad, atol=1e-5) for p, q in zip(dev.parameters(), cpu.parameters())
    )
    return bool(grads and torch.allclose(loss.cpu(), ref, atol=1e-5))


for name, fn in [
    ("elementwise", elementwise),
    ("matmul_views_and_lists", matmul_views_and_lists),
    ("factories_and_reductions", factories_and_reductions),
    ("in_place_and_scalars", in_place_and_scalars),
    ("declined_conjugate_matmul", declined_conjugate_matmul),
    ("out_resize_and_set", out_resize_and_set),
    ("optimizer_steps", optimizer_steps),
    ("memory", memory),
    ("llama_forward", llama_forward),
]:
    counted(name, fn)
out["llama_training_step"] = llama_training_step()

out["errors"] = {
    "cpu_operand": error(lambda: xt + x),
    "other_index": error(lambda: torch.zeros(2, device="tpu:1")),
    "other_index_with_dtype": error(lambda: torch.zeros(2, dtype=torch.float16, device="tpu:1")),
    "sparse": error(lambda: xt.to_sparse()),
    "bad_shape": error(lambda: xt @ xt),
}
hf_tpu.sim.enable(hbm=1024**2)
out["errors"]["oom_fresh_result"] = error(lambda: torch.ones(512, 512, device="tpu") * 2)
big = torch.ones(200, 1024)
small = big.to("tpu")
out["errors"]["oom_op_result"] = error(lambda: torch.cat([small, small, small, small, small, small]))
out["errors"]["oom_out_resize"] = error(lambda: torch.mul(small, 2, out=torch.empty(0, device="tpu")))
print(json.dumps(out, sort_keys=True))
