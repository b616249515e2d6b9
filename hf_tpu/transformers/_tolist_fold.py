"""``tensor.tolist()`` and ``tensor.item()`` of a tensor built from constants only are Python numbers in a compiled
graph, as they are in eager, not reads of a device value on the host.

Vision encoders size their per-image splits and reshapes from small integer tensors they build themselves:
Mistral 3's ``(torch.as_tensor(image_sizes, device=...) // ratio).prod(-1).tolist()``, HyperCLOVA X Vision V2's and
Dots3 Note's ``(image_grid_thw.prod(-1) // merge**2).tolist()``, LFM3-VL's ``grid_thw.tolist()``, transformers'
``get_vision_position_ids`` (``torch.tensor([merge]).expand(n).tolist()``). In hf_tpu's vision graphs the sizes and
grids are host integers, constants of the graph (keyed by them: :func:`hf_tpu.transformers._images.encode_images`),
so every value of those tensors is known while tracing; torch 2.13's dynamo still traces the ``tolist()`` as
``.item()`` calls on the traced tensor (``aten._local_scalar_dense`` with unbacked sizes after it): a read of a
device value on the host, which torch_tpu refuses to lower.

The patched ``TensorVariable.call_method`` computes ``tolist()``/``item()`` on the host when the tensor's whole
history in the graph being traced starts from constants (no graph input, no parameter or buffer), is free of random
or uninitialized values, and nothing in the graph writes into any tensor of that history (an in-place op, an item
assignment): it replays that history on CPU tensors and hands the graph the resulting Python numbers, exactly eager's
values. The traced ops stay in the graph (unused, so dead code there). Any other tensor takes upstream's path, which
traces the read as before (and :func:`hf_tpu.sim.host_reads` names it).
"""

from __future__ import annotations

import functools
import operator

from hf_tpu._patch import original, patch

__all__ = ["FOLDED_METHODS", "apply", "constant_value"]

FOLDED_METHODS = ("tolist", "item")

# ops whose result is not a function of their arguments' values (replaying them would not give the traced value)
_UNREPLAYABLE = ("rand", "normal", "bernoulli", "multinomial", "dropout", "empty", "poisson", "exponential_", "seed")
_MAX_NODES = 256  # (a constant's history longer than this is not a size computation: left to upstream)


def _name(node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", repr(target))


def _writes(node) -> bool:
    """Whether ``node`` writes into a tensor: an in-place method or function (``add_``, ``__setitem__``,
    ``operator.setitem``) or an ``out=`` argument."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = _name(node)
    if node.target in (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv):
        return True
    if name == "__setitem__" or (name.endswith("_") and not name.endswith("__")):
        return True
    return "out" in node.kwargs


def _history(node) -> list | None:
    """The nodes ``node``'s value is computed from (itself included), in graph order; None when that history reaches
    a graph input or an attribute (a value only the running graph knows), holds an op whose result is random or
    uninitialized, or is too long to be a size computation."""
    seen, stack = {}, [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        if current.op not in ("call_function", "call_method") or len(seen) >= _MAX_NODES:
            return None
        name = _name(current).lower()
        if any(word in name for word in _UNREPLAYABLE):
            return None
        seen[current] = None
        stack.extend(_flat_nodes((current.args, current.kwargs)))
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _flat_nodes(value) -> list:
    import torch

    found = []
    torch.fx.node.map_arg(value, found.append)
    return found


def _written(history: list) -> bool:
    """Whether the graph writes into a tensor of ``history`` or into a tensor derived from one (a view of it)."""
    pending, seen = list(history), set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            if _writes(user):
                return True
            pending.append(user)
    return False


def _on_cpu(value):
    """``value`` with every device in it made the CPU (the replay runs on host tensors)."""
    import torch

    if isinstance(value, torch.device):
        return torch.device("cpu")
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    return value


def constant_value(node):
    """The value of the traced tensor ``node`` computed on the host from its history (:func:`_history`), or None
    when it is not a function of constants only."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    history = _history(node)
    if history is None or _written(history):
        return None
    values = {}

    def load(arg):
        return _on_cpu(torch.fx.node.map_arg(arg, values.__getitem__))

    with unset_fake_temporarily():
        for current in history:
            args, kwargs = load(current.args), load(current.kwargs)
            if "device" in kwargs:  # (also a device named by a string: "tpu")
                kwargs["device"] = "cpu"
            try:
                if current.op == "call_method":
                    values[current] = getattr(args[0], current.target)(*args[1:], **kwargs)
                else:
                    values[current] = current.target(*args, **kwargs)
            except Exception:  # (an op that cannot be replayed on the host: upstream's trace decides)
                return None
    result = values[node]
    return result if isinstance(result, torch.Tensor) and result.device.type == "cpu" else None


def apply(feature: str) -> None:
    try:
        from torch._dynamo.variables.builder import SourcelessBuilder
        from torch._dynamo.variables.constant import ConstantVariable
        from torch._dynamo.variables.tensor import TensorVariable
    except ImportError:  # pragma: no cover - a torch whose dynamo moved these classes
        return
    upstream = original(TensorVariable, "call_method")

    @functools.wraps(upstream)
    def call_method(self, tx, name, args, kwargs):
        if name in FOLDED_METHODS and not args and not kwargs and type(self) is TensorVariable:
            try:
                node = self.as_proxy().node
            except Exception:  # pragma: no cover - a tensor variable without a proxy
                node = None
            value = constant_value(node) if node is not None else None
            integral = value is not None and not value.is_floating_point() and not value.is_complex()
            if integral and name == "tolist":
                return SourcelessBuilder.create(tx, value.tolist())
            if integral and value.numel() == 1:
                return ConstantVariable.create(value.item())
        return upstream(self, tx, name, args, kwargs)

    patch(TensorVariable, "call_method", call_method, feature=feature, package="torch", versions=">=2.10,<2.14")
