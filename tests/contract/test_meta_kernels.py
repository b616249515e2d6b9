"""The simulator's mirrored meta kernels against torch-tpu 0.2.0's own (hf_tpu/sim/_meta_kernels.py).

This process has torch_tpu autoloaded, so its registrations are in force; the simulator cannot run here (see
tests/contract/test_simulator_vs_wheel.py), so its kernels answer from a subprocess started with
``TORCH_DEVICE_BACKEND_AUTOLOAD=0 HF_TPU_SIMULATE=1``: there the same calls go through the dispatcher on fake
``tpu`` tensors (what a compiled graph traces), here through the wheel's kernel on meta tensors (no chip, so no
``tpu`` tensors, and the wheel's registered kernel sends other devices to upstream's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

# name -> (self, mat2, offs, bias, out_dtype), each tensor as [shape, dtype, stride or None]
F32, F16, BF16 = "float32", "float16", "bfloat16"
CASES: dict[str, list] = {
    "moe 2d x 3d f32": [[[7, 6], F32], [[3, 6, 5], F32, [30, 1, 6]], [[3], "int32"], None, None],
    "moe 2d x 3d f16 int64 offs": [[[7, 6], F16], [[3, 6, 5], F16], [[3], "int64"], None, None],
    "moe 2d x 3d bf16": [[[16, 8], BF16], [[4, 8, 8], BF16], [[4], "int32"], None, None],
    "2d x 2d": [[[7, 12], F32], [[12, 5], F32], [[3], "int32"], None, None],
    "3d x 2d": [[[3, 7, 6], F32], [[6, 9], F32], [[3], "int32"], None, None],
    "3d x 3d": [[[3, 7, 6], BF16], [[3, 6, 5], BF16], None, None, None],
    "out_dtype same": [[[7, 6], F32], [[3, 6, 5], F32], [[3], "int32"], None, F32],
    "out_dtype other": [[[7, 6], BF16], [[3, 6, 5], BF16], [[3], "int32"], None, F32],
    "float64": [[[7, 6], "float64"], [[3, 6, 5], "float64"], [[3], "int32"], None, None],
    "int32 inputs": [[[7, 6], "int32"], [[3, 6, 5], "int32"], [[3], "int32"], None, None],
    "dtype mismatch": [[[7, 6], F32], [[3, 6, 5], BF16], [[3], "int32"], None, None],
    "bias": [[[7, 6], F32], [[3, 6, 5], F32], [[3], "int32"], [[3, 5], F32], None],
    "int16 offs": [[[7, 6], F32], [[3, 6, 5], F32], [[3], "int16"], None, None],
    "2d offs": [[[7, 6], F32], [[3, 6, 5], F32], [[3, 1], "int32"], None, None],
    "strided offs": [[[7, 6], F32], [[3, 6, 5], F32], [[3], "int32", [2]], None, None],
    "1d self": [[[6], F32], [[3, 6, 5], F32], [[3], "int32"], None, None],
    "4d mat2": [[[7, 6], F32], [[1, 3, 6, 5], F32], [[3], "int32"], None, None],
    "no offs with 2d": [[[7, 6], F32], [[3, 6, 5], F32], None, None, None],
    "offs with 3d x 3d": [[[3, 7, 6], F32], [[3, 6, 5], F32], [[3], "int32"], None, None],
    "groups != mat2 batch": [[[7, 6], F32], [[4, 6, 5], F32], [[3], "int32"], None, None],
    "groups != self batch": [[[2, 7, 6], F32], [[6, 9], F32], [[3], "int32"], None, None],
    "batch mismatch 3d": [[[2, 7, 6], F32], [[3, 6, 5], F32], None, None, None],
    "contraction mismatch": [[[7, 4], F32], [[3, 6, 5], F32], [[3], "int32"], None, None],
}

RUN = textwrap.dedent(
    """
    import json, sys
    import torch

    def tensor(spec, device):
        if spec is None:
            return None
        shape, dtype, *stride = spec
        dtype = getattr(torch, dtype)
        if stride:
            return torch.empty_strided(shape, stride[0], dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device)

    def answer(call, case, device):
        a, b, offs, bias, out_dtype = case
        try:
            out = call(tensor(a, device), tensor(b, device), tensor(offs, device), tensor(bias, device),
                       getattr(torch, out_dtype) if out_dtype else None)
        except Exception as e:  # the refusal: its type and words
            return [type(e).__name__, str(e).splitlines()[0]]
        return ["ok", list(out.shape), str(out.dtype), list(out.stride())]
    """
)

SIM = RUN + textwrap.dedent(
    """
    import hf_tpu.sim
    from torch._subclasses.fake_tensor import FakeTensorMode
    from hf_tpu.sim import _meta_kernels

    def through_dispatcher(a, b, offs, bias, out_dtype):
        mode = FakeTensorMode()
        fake = [None if t is None else mode.from_tensor(t) for t in (a, b, offs, bias)]
        with mode:
            return torch._grouped_mm(*fake[:2], offs=fake[2], bias=fake[3], out_dtype=out_dtype)

    cases = json.loads(sys.argv[1])
    out = {
        "kernel": {name: answer(_meta_kernels.grouped_mm_meta, c, "meta") for name, c in cases.items()},
        "dispatcher": {name: answer(through_dispatcher, c, "tpu") for name, c in cases.items()},
        "mirrored": {name: [mod, fn] for name, (_, mod, fn) in _meta_kernels.MIRRORED.items()},
    }
    print("SIM-JSON" + json.dumps(out))
    """
)

# torch_tpu's C++ Meta kernels (csrc/eager/tpu_aten_kernels.cc) for the fused optimizers' ops: they accept any
# input and compute nothing (see the test below). The simulator does not mirror them: a compiled fused-optimizer
# step with a tensor learning rate does not trace on the simulator (it has no Meta kernel upstream either).
WHEEL_CPP_META_NOT_MIRRORED = {
    f"aten::{op}"
    for op in (
        "_fused_adam_.tensor_lr",
        "_fused_adam.tensor_lr",
        "_fused_adamw_.tensor_lr",
        "_fused_adamw",
        "_fused_adamw.tensor_lr",
        "_fused_sgd_",
        "_fused_sgd",
        "_fused_sgd_.tensor_lr",
        "_fused_sgd.tensor_lr",
        "_fused_adagrad_",
        "_fused_adagrad",
        "_fused_adagrad_.tensor_lr",
        "_fused_adagrad.tensor_lr",
    )
}


@pytest.fixture(scope="module")
def sim() -> dict:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "HF_TPU_SIMULATE": "1"}
    env.pop("HF_TPU_EXPECT_TORCH_TPU", None)
    proc = subprocess.run([sys.executable, "-c", SIM, json.dumps(CASES)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SIM-JSON"))
    return json.loads(line[len("SIM-JSON") :])


def _wheel_answers(kernel) -> dict:
    namespace: dict = {}
    exec(RUN, namespace)  # noqa: S102 - the same helpers as the simulator's side
    return {name: namespace["answer"](kernel, case, "meta") for name, case in CASES.items()}


def test_the_wheel_registers_its_grouped_mm_meta_for_tpu_tensors(sim):
    from torch_tpu._internal.compile import grouped_mm_meta

    op = torch.ops.aten._grouped_mm.default
    registered = op.py_kernels[torch._C.DispatchKey.Meta]
    assert registered.__module__ == grouped_mm_meta.__name__
    assert sim["mirrored"] == {"aten::_grouped_mm": [grouped_mm_meta.__name__, "_tpu_grouped_mm_meta"]}


def test_grouped_mm_mirror_accepts_refuses_and_shapes_as_the_wheel(sim):
    from torch_tpu._internal.compile import grouped_mm_meta

    wheel = _wheel_answers(grouped_mm_meta._tpu_grouped_mm_meta)
    assert sum(v[0] == "ok" for v in wheel.values()) >= 7 and sum(v[0] != "ok" for v in wheel.values()) >= 12
    assert sim["kernel"] == wheel
    # The registered kernel on fake tpu tensors gives the same answers. A NotImplementedError from a meta kernel
    # makes fake tensors run the device's eager kernel instead (bias), whose refusal the simulator words as its own
    # around torch_tpu's message.
    for name, expected in wheel.items():
        got = sim["dispatcher"][name]
        assert got[0] == expected[0], name
        assert got[1:] == expected[1:] if got[0] == "ok" else got[1].endswith(expected[1]), name


def test_the_wheel_overrides_no_other_meta_kernel():
    """Every aten Meta kernel torch_tpu's autoload changes is mirrored or listed above as not mirrored."""
    assert os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "1"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    script = textwrap.dedent(
        """
        import json, torch
        print("META-JSON" + json.dumps({
            n: [line for line in torch._C._dispatch_dump_table(n).splitlines() if line.startswith("Meta:")]
            for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")
        }))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    upstream = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("META-JSON"))[9:])
    changed = set()
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        here = [line for line in torch._C._dispatch_dump_table(name).splitlines() if line.startswith("Meta:")]
        # (an op torch_tpu defines, e.g. aten::ctc_loss, only has the fallback that refuses Meta tensors)
        if here != upstream.get(name, []) and not all("MetaFallbackKernel" in line for line in here):
            changed.add(name)
    assert changed == {"aten::_grouped_mm"} | WHEEL_CPP_META_NOT_MIRRORED


def test_the_wheels_fused_optimizer_metas_compute_nothing():
    """What the not-mirrored C++ kernels do: accept mismatched inputs and return nothing (no checks to mirror)."""
    p, g = [torch.empty(3, device="meta")], [torch.empty(4, device="meta", dtype=torch.bfloat16)]
    lr = torch.empty(2, device="meta")
    kw = dict(beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=True, maximize=False)
    assert torch.ops.aten._fused_adamw_.tensor_lr(p, g, [], [], [], [], lr=lr, **kw) is None
    sgd = dict(weight_decay=0.0, momentum=0.9, lr=0.1, dampening=0.0, nesterov=False, maximize=False)
    assert torch.ops.aten._fused_sgd_.default(p, g, [], is_first_step=True, **sgd) is None
