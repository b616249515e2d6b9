"""The optimizer's update and the gradient clipping as compiled programs on a TPU, instead of eager ops.

On torch_tpu every eager op is a dispatch of its own (~0.05-0.2 ms on a v5e), and a training step's optimizer
update is many of them: torch's AdamW runs a dozen list ops per parameter group, the gradient clipping half a dozen
more, and a list op that the device runs tensor by tensor costs one dispatch per parameter tensor. A lean JAX step
fuses the whole update into one program. Here:

- :class:`AdamW` is ``torch.optim.AdamW`` (same arguments, state and ``state_dict``, so schedulers, checkpoints and
  ``isinstance`` checks see upstream's optimizer) whose ``step`` on ``tpu`` parameters runs torch's own AdamW update
  (``torch.optim.adam.adam``, the list-op form, capturable) for every parameter group inside one graph compiled
  with ``torch.compile(backend="tpu")``. The learning rate enters the graph as a device tensor, refreshed by one
  ``fill_`` when a scheduler changed it, so a schedule never recompiles; each step counter lives on the device as
  torch's capturable AdamW keeps it. Elsewhere (CPU parameters, FSDP2's DTensors, complex parameters,
  ``differentiable``/``fused`` groups, ``HF_TPU_OPTIMIZER=eager``) it is upstream's step.
- :func:`clip_grad_norm_` is ``torch.nn.utils.clip_grad_norm_`` compiled into one graph on ``tpu`` gradients (the
  norm and the scaling), upstream's elsewhere.

``hf_tpu.enable()`` (integration ``training``) makes the Trainer use both on a TPU: ``optim="adamw_torch"`` (and
``adamw_torch_fused``) builds this :class:`AdamW`, and accelerate's ``Accelerator.clip_grad_norm_`` clips with
:func:`clip_grad_norm_` (see :mod:`hf_tpu.training._integration`). A plain loop uses them directly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import adam as _adam

from hf_tpu import _env

__all__ = ["AdamW", "clip_grad_norm_", "compiled_on"]


def compiled_on() -> bool:
    """Whether the optimizer's step and the clipping compile on a TPU (``HF_TPU_OPTIMIZER``, ``compiled`` by
    default; ``eager``: upstream's eager ops)."""
    return _env.OPTIMIZER.get() == "compiled"


def _plain_tpu(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor is a plain ``tpu`` tensor (not a DTensor or another subclass, not complex)."""
    return bool(tensors) and all(
        type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "tpu" and not t.is_complex()
        for t in tensors
    )


_LIMITS: dict[str, Any] = {}


def _limits() -> dict[str, Any]:
    """Dynamo's recompile limits raised for these functions: each model's parameter list is a graph of its own (one
    per process and model), and past the default limit (8) dynamo would silently run the rest eagerly."""
    if not _LIMITS:
        config = torch._dynamo.config
        _LIMITS["recompile_limit"] = max(config.recompile_limit, 1024)
        if hasattr(config, "accumulated_recompile_limit"):
            _LIMITS["accumulated_recompile_limit"] = max(config.accumulated_recompile_limit, 4096)
    return _LIMITS


_COMPILED: dict[str, Any] = {}


def _compiled(name: str, fn: Any) -> Any:
    compiled = _COMPILED.get(name)
    if compiled is None:
        compiled = _COMPILED[name] = torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False)
    return compiled


# ---- gradient clipping --------------------------------------------------------------------------------------------


def _clip(parameters: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite=False, foreach=True)


def clip_grad_norm_(
    parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """``torch.nn.utils.clip_grad_norm_``, as one compiled graph when every gradient is on a TPU.

    The total norm and the scaling of the gradients in place are the graph; ``max_norm`` and ``norm_type`` are
    constants in it (one graph per value). Upstream's function runs instead where a gradient is not a plain ``tpu``
    tensor, where ``error_if_nonfinite`` asks for a host read, where ``foreach=False`` asks for per-tensor ops, or
    with ``HF_TPU_OPTIMIZER=eager``.

    Args:
        parameters: the parameters (or one tensor) whose gradients are clipped.
        max_norm: the largest total norm kept.
        norm_type: the p of the p-norm (``inf`` for the largest magnitude).
        error_if_nonfinite: raise when the total norm is not finite (upstream's path: a host read).
        foreach: upstream's ``foreach`` (``False``: upstream's per-tensor path).

    Returns:
        The total norm of the gradients before clipping, a 0-d tensor on their device.

    Example:
        >>> norm = clip_grad_norm_(model.parameters(), 1.0)     # doctest: +SKIP
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if error_if_nonfinite or foreach is False or not compiled_on() or not _plain_tpu(grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    with_grads = [p for p in params if p.grad is not None]
    with torch._dynamo.config.patch(**_limits()):
        return _compiled("clip", _clip)(with_grads, float(max_norm), float(norm_type))


# ---- AdamW --------------------------------------------------------------------------------------------------------


def _adamw(groups: list[tuple], lrs: list[torch.Tensor]) -> None:
    """Every parameter group's AdamW update: torch's own (``torch.optim.adam.adam``, list ops, capturable)."""
    for (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options), lr in zip(groups, lrs):
        amsgrad, beta1, beta2, weight_decay, eps, maximize, decoupled = options
        _adam.adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, foreach=True, capturable=True,
            differentiable=False, fused=None, grad_scale=None, found_inf=None, has_complex=False, amsgrad=amsgrad,
            beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize,
            decoupled_weight_decay=decoupled,
        )  # fmt: skip


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``step`` on ``tpu`` parameters is one compiled program (see the module).

    Takes upstream's arguments and keeps upstream's state (``step``, ``exp_avg``, ``exp_avg_sq``; the step counters
    on the parameters' device, as upstream's capturable AdamW keeps them), so ``state_dict``/``load_state_dict``,
    learning-rate schedulers and checkpoints work as with upstream's. The first step also creates the state (eager
    ops, once); each later step is the compiled graph plus, when the learning rate changed, one ``fill_`` per group.

    Example:
        >>> from hf_tpu.training import AdamW
        >>> opt = AdamW(model.parameters(), lr=3e-4)     # doctest: +SKIP
        >>> loss.backward(); opt.step(); opt.zero_grad()  # doctest: +SKIP
    """

    def _compilable(self) -> bool:
        for group in self.param_groups:
            if group["differentiable"] or group["fused"] or group["foreach"] is False:
                return False
            if not torch.is_tensor(group["lr"]) and not isinstance(group["lr"], (int, float)):
                return False
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        return _plain_tpu(params) and all(not p.grad.is_sparse for p in params) and compiled_on()

    def _lr_tensor(self, index: int, group: dict, device: torch.device) -> torch.Tensor:
        """The group's learning rate as a 0-d float32 tensor on ``device``: refreshed with one ``fill_`` when the
        group's value changed since the last step (a scheduler's), so the graph never bakes it in."""
        lr = group["lr"]
        if torch.is_tensor(lr):
            return lr if lr.device == device else lr.to(device)
        cache = self.__dict__.setdefault("_hf_tpu_lrs", {})
        value, tensor = cache.get(index, (None, None))
        if tensor is None or tensor.device != device:
            tensor = torch.tensor(float(lr), dtype=torch.float32).to(device)
        elif value != lr:
            tensor.fill_(float(lr))
        cache[index] = (lr, tensor)
        return tensor

    def _group_lists(self, group: dict) -> tuple | None:
        """Upstream's ``_init_group`` for the compiled step: the lists of one group's tensors, creating the state on
        first use, with each step counter on its parameter's device (moved there once when it was on the host)."""
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != p.device:  # upstream's non-capturable AdamW keeps it on the host
                state["step"] = state["step"].to(p.device, torch.float32)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return None
        beta1, beta2 = group["betas"]
        options = (
            bool(group["amsgrad"]), float(beta1), float(beta2), float(group["weight_decay"]), float(group["eps"]),
            bool(group["maximize"]), bool(group.get("decoupled_weight_decay", True)),
        )  # fmt: skip
        return params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of every parameter with a gradient: one compiled graph on a TPU, upstream's elsewhere.

        Args:
            closure: re-evaluates the model and returns the loss (upstream's argument).

        Returns:
            The closure's loss, or None.
        """
        if not self._compilable():
            upstream = torch.optim.AdamW.step
            # (upstream's step without torch's hook wrapper: this class's step, which called us, ran the hooks)
            return getattr(upstream, "__wrapped__", upstream)(self, closure) if getattr(upstream, "hooked", False) \
                else upstream(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups, lrs = [], []
        for index, group in enumerate(self.param_groups):
            lists = self._group_lists(group)
            if lists is not None:
                groups.append(lists)
                lrs.append(self._lr_tensor(index, group, lists[0][0].device))
        if groups:
            with torch._dynamo.config.patch(**_limits()):
                _compiled("adamw", _adamw)(groups, lrs)
        return loss
