"""The optimizer's update and the gradient clipping as compiled programs on a TPU, instead of eager ops.

On torch_tpu every eager op is a dispatch of its own (~0.05-0.2 ms on a v5e), and a training step's optimizer
update is many of them: torch's AdamW runs a dozen list ops per parameter group, the gradient clipping half a dozen
more, and a list op that the device runs tensor by tensor costs one dispatch per parameter tensor. A lean JAX step
fuses the whole update into one program. Here:

- :class:`AdamW` is ``torch.optim.AdamW`` (same arguments, state and ``state_dict``, so schedulers, checkpoints and
  ``isinstance`` checks see upstream's optimizer) whose ``step`` on ``tpu`` parameters runs torch's own AdamW update
  (``torch.optim.adam.adam``, the list-op form, capturable) in graphs compiled with ``torch.compile(backend="tpu")``,
  one per bucket of parameters: one parameter group's tensors of one shape and dtype (all 16 ``q_proj`` weights of
  a 16-layer model together), a bucket over :data:`BUCKET_BYTES` cut into sub-lists of one length. So a model has a
  handful of graphs whatever its depth, each compiled once, and no program holds every tensor's input and output at
  once. Each graph works on clones and returns the new parameters, moments and step counters in their own dtypes;
  the step rebinds them (``param.data``, which runs no device op and leaves a compiled model's graphs as they are,
  and the state's entries). A graph that wrote its inputs instead would cost, on torch-tpu 0.2.0, one eager
  ``copy_`` back per written tensor (its backend keeps no write inside the program and donates nothing). The
  learning rate enters each graph as a device tensor, refreshed by one ``fill_`` when a scheduler changed it, so a
  schedule never recompiles; each step counter lives on the device as torch's capturable AdamW keeps it. Elsewhere
  (CPU parameters, FSDP2's DTensors, complex parameters, ``differentiable``/``fused`` groups,
  ``HF_TPU_OPTIMIZER=eager``) it is upstream's step.
- :func:`clip_grad_norm_` is ``torch.nn.utils.clip_grad_norm_`` as compiled graphs on ``tpu`` gradients: one that
  reads every gradient and returns the total norm and the clipping factor, and one per bucket of gradients that
  returns them scaled (each ``.grad`` rebound); upstream's elsewhere.

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


#: The most bytes of one bucket's tensors (a parameter and each state it updates) that one program writes: a bucket
#: over it is cut into sub-lists of one length (one graph for them all, and one for a shorter rest).
BUCKET_BYTES = 2 << 30


def _buckets(tensors: list[torch.Tensor], copies: int) -> list[list[int]]:
    """The indices of ``tensors`` in buckets of one shape and dtype each (in first-seen order), each bucket cut into
    sub-lists of one length where its tensors times ``copies`` (the tensors a program writes per entry) exceed
    :data:`BUCKET_BYTES`. Each bucket is one graph, reused every step: a handful for a transformer, whatever its
    depth, and no program holds the inputs and outputs of every tensor at once."""
    by_key: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        by_key.setdefault((tuple(t.shape), t.dtype), []).append(i)
    out = []
    for indices in by_key.values():
        t = tensors[indices[0]]
        per = max(1, BUCKET_BYTES // max(1, t.numel() * t.element_size() * copies))
        pieces = -(-len(indices) // per)
        size = -(-len(indices) // pieces)
        out += [indices[i : i + size] for i in range(0, len(indices), size)]
    return out


def _own_dtypes(tensors: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` cast to the dtypes of ``like``, as ops of the graph even where the traced dtypes already agree:
    torch-tpu 0.2.0 computes a list op of bfloat16 tensors and a float32 scalar tensor (the learning rate, the
    clipping factor) in float32 whatever the trace says, and its program returns that float32 value."""
    return [t.to(dtype=o.dtype, copy=True) for t, o in zip(tensors, like)]


# ---- gradient clipping --------------------------------------------------------------------------------------------


def _norm(grads: list[torch.Tensor], max_norm: float, norm_type: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The total norm of the gradients and upstream's clipping factor (``max_norm / (norm + 1e-6)``, at most 1):
    reads the gradients, writes nothing."""
    total = torch.nn.utils.get_total_norm(grads, norm_type, False, True)
    return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _scale(grads: list[torch.Tensor], factor: torch.Tensor) -> list[torch.Tensor]:
    """One bucket of gradients times the clipping factor, as new tensors in the gradients' dtype."""
    return _own_dtypes(torch._foreach_mul(grads, factor), grads)


def clip_grad_norm_(
    parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """``torch.nn.utils.clip_grad_norm_``, as compiled graphs when every gradient is on a TPU.

    One graph reads every gradient and returns the total norm and the clipping factor; one graph per bucket of
    gradients of one shape and dtype (cut as :func:`_buckets` cuts them) returns them scaled, and each parameter's
    ``.grad`` is rebound to its new tensor (no graph writes its inputs: torch_tpu would copy each write back with an
    eager op). ``max_norm`` and ``norm_type`` are constants of the norm's graph (one graph per value). Upstream's
    function runs instead where a gradient is not a plain ``tpu`` tensor, where ``error_if_nonfinite`` asks for a host
    read, where ``foreach=False`` asks for per-tensor ops, or with ``HF_TPU_OPTIMIZER=eager``.

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
    del grads
    with torch._dynamo.config.patch(**_limits()):
        total, factor = _compiled("norm", _norm)([p.grad for p in with_grads], float(max_norm), float(norm_type))
        for bucket in _buckets([p.grad for p in with_grads], 2):
            scaled = _compiled("scale", _scale)([with_grads[i].grad for i in bucket], factor)
            for i, g in zip(bucket, scaled):
                p = with_grads[i]
                p.grad = g if g.dtype == p.grad.dtype else g.to(p.grad.dtype)  # (as for the parameters: _update)
            del scaled
    return total


# ---- AdamW --------------------------------------------------------------------------------------------------------


def _adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, options):
    """One bucket's AdamW update, torch's own (``torch.optim.adam.adam``, list ops, capturable), on clones of the
    parameters and states: returns their new values (in the parameters' dtype, the steps' float32) and writes no
    input."""
    amsgrad, beta1, beta2, weight_decay, eps, maximize, decoupled = options
    params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = (
        [t.clone() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
    )
    _adam.adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, foreach=True, capturable=True,
        differentiable=False, fused=None, grad_scale=None, found_inf=None, has_complex=False, amsgrad=amsgrad,
        beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize,
        decoupled_weight_decay=decoupled,
    )  # fmt: skip
    return tuple(_own_dtypes(ts, like) for ts, like in zip(
        (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps), (grads, grads, grads, grads, steps)
    ))  # fmt: skip


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``step`` on ``tpu`` parameters is a few compiled programs (see the module).

    Takes upstream's arguments and keeps upstream's state (``step``, ``exp_avg``, ``exp_avg_sq``; the step counters
    on the parameters' device, as upstream's capturable AdamW keeps them), so ``state_dict``/``load_state_dict``,
    learning-rate schedulers and checkpoints work as with upstream's. The first step also creates the state (eager
    ops, once); each later step is one compiled graph per bucket of parameters (one parameter group, one shape and
    dtype: :func:`_buckets`), whose results the step rebinds (``param.data``, the state's entries), plus, when the
    learning rate changed, one ``fill_`` per group.

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

    def _group_params(self, group: dict) -> list[torch.Tensor]:
        """Upstream's ``_init_group`` for the compiled step: one group's parameters with a gradient, creating their
        state on first use, each step counter on its parameter's device (moved there once when it was on the
        host)."""
        params = []
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
        return params

    def _update(self, params: list[torch.Tensor], group: dict, lr: torch.Tensor) -> None:
        """One bucket's compiled update, its results rebound: each parameter's ``.data`` (no device op) and its
        state's entries. The old buffers go as the bucket's references to them go."""
        beta1, beta2 = group["betas"]
        options = (
            bool(group["amsgrad"]), float(beta1), float(beta2), float(group["weight_decay"]), float(group["eps"]),
            bool(group["maximize"]), bool(group.get("decoupled_weight_decay", True)),
        )  # fmt: skip
        states = [self.state[p] for p in params]
        names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if options[0] else ())
        new_params, *new_states, new_steps = _compiled("adamw", _adamw)(
            params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states] if options[0] else [], [s["step"] for s in states], lr, options,
        )  # fmt: skip
        for i, (p, state) in enumerate(zip(params, states)):
            new = new_params[i]
            # (the graph casts to the parameter's dtype; a backend that still returned another: one eager cast here,
            # never a silent change of the parameter's dtype)
            p.data = new if new.dtype == p.dtype else new.to(p.dtype)
            for name, values in zip(names, new_states):
                state[name] = values[i]
            state["step"] = new_steps[i]

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of every parameter with a gradient: compiled graphs on a TPU, upstream's elsewhere.

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
        with torch._dynamo.config.patch(**_limits()):
            for index, group in enumerate(self.param_groups):
                params = self._group_params(group)
                if not params:
                    continue
                lr = self._lr_tensor(index, group, params[0].device)
                copies = 4 if group["amsgrad"] else 3  # (the parameter and the moments a program writes)
                for bucket in _buckets(params, copies):
                    self._update([params[i] for i in bucket], group, lr)
        return loss
