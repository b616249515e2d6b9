"""Self-test checks of the runtime and the ``tpu`` device itself (see :mod:`hf_tpu.selftest`).

They run first: if this process has no ``tpu`` device, the ``runtime`` check fails with the fix and every other
check is skipped.
"""

from __future__ import annotations

from typing import Any

from hf_tpu.errors import HfTpuRuntimeError
from hf_tpu.selftest import CheckContext, CheckFailed, SkipCheck, register_check


@register_check("runtime", description="a tpu device is present: mode, generation, chips, HBM", order=0)
def _runtime(ctx: CheckContext) -> dict[str, Any]:
    from hf_tpu import runtime

    info = runtime.require_tpu("hf-tpu selftest")
    import torch

    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != "tpu":
        raise HfTpuRuntimeError(f"runtime mode is {info.mode!r} but torch.accelerator reports {accelerator}")
    count = torch.accelerator.device_count()
    if count < 1:
        raise HfTpuRuntimeError(f"runtime mode is {info.mode!r} but torch.accelerator.device_count() is {count}")
    if info.hbm_bytes <= 0:
        raise HfTpuRuntimeError(f"HBM per device is unknown for generation {info.generation!r}")
    return {
        "mode": info.mode,
        "generation": info.generation,
        "devices_in_process": count,
        "chips_on_host": info.chips_on_host,
        "hbm_gib": round(info.hbm_bytes / 1024**3, 2),
    }


@register_check(
    "torch_tpu_api",
    description="the torch_tpu names hf_tpu relies on exist in the installed torch-tpu (hf_tpu._torch_tpu)",
    order=0,
)
def _torch_tpu_api(ctx: CheckContext) -> dict[str, Any]:
    from hf_tpu import _torch_tpu

    if ctx.info.mode != "real":
        raise SkipCheck("the simulated device does not use torch_tpu (tests/contract checks these names against it)")
    missing = _torch_tpu.missing_names()
    if missing:
        raise HfTpuRuntimeError(
            f"torch-tpu {_torch_tpu.installed_version()} lacks {len(missing)} name(s) hf_tpu was written against "
            f"(torch-tpu {_torch_tpu.WRITTEN_FOR}): {', '.join(missing)}"
        )
    return {"torch_tpu": _torch_tpu.installed_version(), "tables": _torch_tpu.source()}


@register_check(
    "precision",
    description="float32 matmuls at each torch.set_float32_matmul_precision setting err as measured on a chip",
    order=1,
)
def _precision(ctx: CheckContext) -> dict[str, Any]:
    """A 256x256 float32 matmul at 'medium' (a TPU's default: one bfloat16 pass), 'high' and 'highest', against
    float64: each within twice the error a TPU v5e showed (hf_tpu.numerics.CHIP_MATMUL_ERROR), and 'medium' the
    default. The user's setting is restored."""
    import torch

    from hf_tpu import numerics

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
    want = a.double() @ b.double()
    ad, bd = ctx.to_device(a), ctx.to_device(b)
    before = torch.get_float32_matmul_precision()
    figures: dict[str, Any] = {"default": before}
    try:
        for precision in numerics.PRECISIONS:
            torch.set_float32_matmul_precision(precision)
            figures[f"{precision}_max_err"] = float(f"{numerics.max_error(ad @ bd, want):.3g}")
    finally:
        torch.set_float32_matmul_precision(before)
    over = {
        p: (figures[f"{p}_max_err"], 2 * max(e, 5e-7))
        for p, e in numerics.CHIP_MATMUL_ERROR.items()
        if figures[f"{p}_max_err"] > 2 * max(e, 5e-7)
    }
    if over:
        raise CheckFailed(
            "float32 matmul error over twice a chip's at "
            + ", ".join(f"{p!r}: {err:.3g} > {bound:.3g}" for p, (err, bound) in over.items())
        )
    return figures


@register_check("device", description="tensors, ops, a tiny MLP forward and backward match CPU", order=1)
def _device(ctx: CheckContext) -> dict[str, Any]:
    import torch

    figures: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g)
    w = torch.randn(48, 32, generator=g)

    # A round trip is exact, and the tensor really is on the device.
    with ctx.measure(figures, "roundtrip"):
        xd = ctx.to_device(x)
        back = xd.cpu()
    if xd.device.type != "tpu":
        raise HfTpuRuntimeError(f"x.to('tpu') landed on {xd.device}")
    if not torch.equal(back, x):
        raise CheckFailed("a tensor copied to the device and back changed")

    wd = ctx.to_device(w)
    # float32 products at the precision in force (a TPU's default, 'medium', is one bfloat16 pass): the tolerance
    # is that precision's, measured on a chip (hf_tpu.numerics)
    want = torch.nn.functional.gelu(x @ w).sum(0)
    with ctx.measure(figures, "matmul_cold"):
        ctx.compare(torch.nn.functional.gelu(xd @ wd).sum(0), want, figures, what="gelu(x @ w).sum(0)")
    with ctx.measure(figures, "matmul_warm"):
        ctx.compare(torch.nn.functional.gelu(xd @ wd).sum(0), want, figures, what="gelu(x @ w).sum(0)")
    # bfloat16, the dtype TPUs compute in.
    ctx.assert_close(
        (xd.bfloat16() @ wd.bfloat16()).float(), (x.bfloat16() @ w.bfloat16()).float(), rtol=2e-2, atol=2e-2
    )
    # Views alias their base; in-place ops write through.
    view = xd[:, :8]
    view.mul_(2)
    expected = x.clone()
    expected[:, :8] *= 2
    ctx.assert_close(xd, expected)

    # A tiny MLP: forward and one SGD step equal CPU.
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    dev_model = ctx.to_device(torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)))
    dev_model.load_state_dict(cpu_model.state_dict())
    target = torch.randn(64, 8, generator=g)
    for model, inp, tgt in ((cpu_model, x, target), (dev_model, ctx.to_device(x), ctx.to_device(target))):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = torch.nn.functional.mse_loss(model(inp), tgt)
        loss.backward()
        opt.step()
    for (name, p_cpu), p_dev in zip(cpu_model.named_parameters(), dev_model.parameters(), strict=True):
        ctx.compare(p_dev, p_cpu.detach(), figures, layers=2, what=f"parameter {name} after one SGD step")
    if ctx.simulated:
        from hf_tpu.sim._counters import STATE

        # ops torch_tpu lacks that ran on the host (only with hf_tpu.sim.execution_mode.enable_cpu_fallback on)
        figures["cpu_fallbacks"] = STATE.cpu_fallbacks
    return figures


@register_check(
    "compile", description="torch.compile(backend='tpu') matches eager; a second call compiles nothing", order=2
)
def _compile(ctx: CheckContext) -> dict[str, Any]:
    import torch

    def fn(a, b):  # attention's shape: scaled scores, so that softmax's inputs have a unit scale
        return torch.softmax(a @ b / 32**0.5, dim=-1) * 2 + 1

    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(16, 32, generator=g), torch.randn(32, 16, generator=g)
    expected = fn(a, b)
    compiled = torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False)
    ad, bd = ctx.to_device(a), ctx.to_device(b)
    figures: dict[str, Any] = {}
    with ctx.measure(figures, "cold"):
        ctx.compare(compiled(ad, bd), expected, figures, what="the compiled softmax(a @ b / 32**0.5) * 2 + 1")
    with ctx.measure(figures, "warm"):
        ctx.compare(compiled(ad, bd), expected, figures, what="the compiled softmax(a @ b / 32**0.5) * 2 + 1")
    if ctx.simulated and figures["warm_compiles"] != 0:
        raise CheckFailed(f"the second call with the same shapes compiled again ({figures['warm_compiles']})")
    return figures
