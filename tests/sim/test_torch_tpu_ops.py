"""The simulated device runs what torch-tpu 0.2.0 runs and refuses what it refuses (hf_tpu/sim/_torch_tpu_ops.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _timeouts import SAFETY_TIMEOUT_S

import hf_tpu.sim
from hf_tpu.sim import _attention, _torch_tpu_ops, execution_mode

REPO = Path(__file__).resolve().parents[2]


def _x(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _i8(*shape, seed=0):
    return torch.randint(-8, 8, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# (refused op as torch_tpu names it, the call on CPU or tpu tensors)
SAMPLES = [
    ("aten::median", lambda d: _x(7).to(d).median()),
    ("aten::median.dim_values", lambda d: _x(3, 5).to(d).median(dim=1).values),
    ("aten::nansum", lambda d: _x(4, 4).to(d).nansum()),
    ("aten::kthvalue.values", lambda d: _x(6).to(d).kthvalue(2).values),
    ("aten::logaddexp.out", lambda d: torch.logaddexp(_x(5).to(d), _x(5, seed=1).to(d))),
    ("aten::erfc.out", lambda d: torch.erfc(_x(5).to(d))),
    ("aten::std_mean.correction", lambda d: torch.std_mean(_x(4, 3).to(d), dim=0)[0]),
    ("aten::_int_mm", lambda d: torch._int_mm(_i8(32, 32).to(d), _i8(32, 32, seed=1).to(d))),
    ("aten::_weight_int8pack_mm", lambda d: torch.ops.aten._weight_int8pack_mm(
        _x(2, 16).to(d), _i8(8, 16).to(d), _x(8).to(d)
    )),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", lambda d: _CPU_FLASH(
        _x(1, 2, 4, 8).to(d), _x(1, 2, 4, 8, seed=1).to(d), _x(1, 2, 4, 8, seed=2).to(d)
    )[0]),
]  # fmt: skip


def test_the_table_has_the_ops_the_issue_names():
    for op in ("_weight_int8pack_mm", "_int_mm", "_weight_int4pack_mm", "_convert_weight_to_int4pack", "median",
               "_unique", "_efficient_attention_forward", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_flash_attention_for_cpu"):  # fmt: skip
        assert op in _torch_tpu_ops.REFUSED, op
    for op in ("_grouped_mm", "_scaled_mm", "_scaled_dot_product_fused_attention_overrideable", "mm.out", "addmm.out"):
        assert op in _torch_tpu_ops.KERNELS, op
    assert not _torch_tpu_ops.REFUSED & _torch_tpu_ops.KERNELS


@pytest.mark.parametrize("name,call", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_refused_ops_raise_torch_tpus_error_and_run_on_the_host_with_the_cpu_fallback(name, call):
    ref = call("cpu")
    with pytest.raises(RuntimeError) as info:
        call("tpu")
    text = str(info.value)
    assert text.startswith(f"operator '{name}' is not implemented for TPU. Please file a feature request"), text
    assert "enable_cpu_fallback" in text
    assert execution_mode.enable_cpu_fallback is False  # torch_tpu's default
    with execution_mode.cpu_fallback(), hf_tpu.sim.stats() as s:
        got = call("tpu")
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), ref, rtol=0, atol=0)
    assert s.cpu_fallbacks >= 1
    assert execution_mode.enable_cpu_fallback is False


def test_the_cpu_fallback_switch_is_a_module_property_as_on_torch_tpu():
    x = _x(5).to("tpu")
    execution_mode.enable_cpu_fallback = True
    try:
        with hf_tpu.sim.stats() as s:
            m = x.median()
            y = x * 2  # an op torch_tpu has: not counted
        assert s.cpu_fallbacks == 1 and "ops run on the host (CPU fallback):      1" in s.report()
    finally:
        execution_mode.enable_cpu_fallback = False
    assert m.item() == _x(5).median().item() and torch.equal(y.cpu(), _x(5) * 2)
    with pytest.raises(RuntimeError, match="aten::median"):
        x.median()


def test_suggestions_name_what_to_use_instead():
    with pytest.raises(RuntimeError, match="torch.sort"):
        _x(5).to("tpu").median()
    with pytest.raises(RuntimeError, match="GradScaler"):
        torch._amp_update_scale_(
            torch.ones(1, device="tpu"), torch.zeros(1, dtype=torch.int32, device="tpu"),
            torch.zeros(1, device="tpu"), 2.0, 0.5, 10,
        )  # fmt: skip


def _sdpa_inputs(shape, dtype=torch.float32):
    return [_x(*shape, dtype=dtype, seed=i) for i in range(3)]


@pytest.mark.parametrize(
    "shape,dtype,dropout,expected",
    [
        ((2, 4, 8, 16), torch.float32, 0.0, _attention.FLASH),
        ((2, 4, 8, 16), torch.bfloat16, 0.0, _attention.FLASH),
        ((2, 4, 8, 16), torch.float16, 0.0, _attention.OVERRIDEABLE),  # flash takes float32/bfloat16 only
        ((1, 2, 8, 200), torch.float32, 0.0, _attention.OVERRIDEABLE),  # head dim 200: neither < 128 nor 128k
        ((4, 8, 16), torch.float32, 0.0, _attention.MATH),  # no batch dimension: neither kernel
        ((2, 4, 8, 16), torch.float32, 0.5, _attention.FLASH),
        ((2, 4, 8, 16), torch.float16, 0.5, _attention.MATH),
    ],
)
def test_sdpa_takes_the_backend_torch_tpu_chooses(shape, dtype, dropout, expected):
    q, k, v = (t.to("tpu") for t in _sdpa_inputs(shape, dtype))
    assert _attention.choose(q, k, v, None, dropout) == expected


def test_sdpa_runs_the_chips_kernel_as_one_op_equal_to_cpu_and_never_the_cpus_flash_op():
    q, k, v = _sdpa_inputs((2, 4, 8, 16))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    qt, kt, vt = (t.to("tpu").requires_grad_() for t in (q, k, v))
    with hf_tpu.sim.stats() as s:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    assert s.ops == 1
    torch.testing.assert_close(out.detach().cpu(), ref, rtol=0, atol=0)
    out.sum().backward()
    q.requires_grad_()
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    torch.testing.assert_close(qt.grad.cpu(), q.grad)
    # rank-3 inputs take the math decomposition on a chip: several device ops, same numbers
    q3, k3, v3 = (t[0] for t in (q.detach(), k, v))
    with hf_tpu.sim.stats() as s:
        out3 = F.scaled_dot_product_attention(q3.to("tpu"), k3.to("tpu"), v3.to("tpu"))
    assert s.ops > 3
    torch.testing.assert_close(out3.cpu(), F.scaled_dot_product_attention(q3, k3, v3))


def test_sdpa_with_every_backend_disabled_raises_torch_tpus_error():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.to("tpu") for t in _sdpa_inputs((4, 8, 16)))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.raises(RuntimeError, match="no viable SDPBackend"):
        F.scaled_dot_product_attention(q, k, v)


def test_autocast_follows_torch_tpus_policy():
    a, b = _x(4, 4).to("tpu"), _x(4, 4, seed=1).to("tpu")
    with torch.autocast("tpu"):
        assert (a @ b).dtype == torch.bfloat16  # lower_precision_fp
        assert torch.prod(a.bfloat16()).dtype == torch.float32  # fp32_set_opt_dtype
        assert F.mse_loss(a.bfloat16(), b.bfloat16()).dtype == torch.float32  # fp32
        assert (a.bfloat16() + b).dtype == torch.float32  # not in the policy: type promotion as usual
        assert torch.cumsum(a.bfloat16(), 0).dtype == torch.bfloat16  # not in the policy: unchanged
    assert "prod" in _torch_tpu_ops.AUTOCAST["fp32_set_opt_dtype"]


def test_flex_attention_is_unavailable_once_the_simulator_is_enabled_as_on_a_tpu_host():
    code = (
        "from transformers.utils.import_utils import is_torch_flex_attn_available as f\n"
        "first = f()\n"
        "import hf_tpu.sim\n"
        "print(first, f())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_TPU_SIMULATE"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=SAFETY_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False"], proc.stdout
