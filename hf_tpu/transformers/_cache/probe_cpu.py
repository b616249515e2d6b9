"""The cache probe's fallback: a real run on the CPU of a copy of the model whose weights take no memory.

Some models read a tensor's value in their forward even given embeddings: a padding check (``mask.all()`` in the
bidirectional masks of BigBird, MegatronBERT, RemBERT), an expert loop over the routing result
(``expert_size.tolist()`` in JetMoE, ``expert_idx.item()`` in LongCat-Flash). The ``meta`` device has no values, so
:mod:`~hf_tpu.transformers._cache.probe` runs such a model here instead: its class, built from the same config
(every size kept: the cache shapes are exactly what the real model writes, layer by layer), on the CPU, with real
values. Its buffers are computed as the class computes them (rotary frequencies, position ids); each parameter is a
zero broadcast from one element, in the real model's dtype for it (weights the real model ties stay tied), and no
weight is allocated while the class builds (:class:`_LargeOnMeta`), so a model of any size costs a few bytes per
parameter (LongCat-Flash's default config, 741B parameters: 18 s, 50 MiB); a matrix product with such a weight is
answered as the zeros it is (:class:`ZeroWeightProducts`) instead of being materialized. Nothing runs on the TPU,
and the real model is only read for its parameters' names and dtypes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ZeroWeightProducts", "cpu_probe"]

_aten = torch.ops.aten
_PRODUCTS = {_aten.mm.default, _aten.bmm.default}  # a product with a zero weight is zero
_BIASED = {_aten.addmm.default, _aten.baddbmm.default}  # beta * input + alpha * product: beta * input
_LARGE = 1 << 20  # elements: a gather of a zero weight at least this large stays a broadcast zero
_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn}
_LARGE_INIT = 1 << 26  # elements: a tensor the class creates at least this large is a weight, created on meta


def _meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


class ZeroWeightProducts(TorchDispatchMode):
    """Matrix products with the copy's zero weights answered as zeros (of the shape and dtype the product has) without
    materializing the weight: CPU BLAS copies a broadcast operand into a dense one first, and a model's lm_head alone
    is gigabytes. A large gather of rows of a zero weight (an expert's weights, selected per token) stays a broadcast
    zero for the product that follows it.

    ``zeros``: the zero weights (views of them count: a transpose, an expert's slice)."""

    def __init__(self, zeros) -> None:
        super().__init__()
        self._storages = {w.untyped_storage().data_ptr() for w in zeros}

    def _is_zero(self, t) -> bool:
        return (
            isinstance(t, torch.Tensor) and t.numel() > 1 and not any(t.stride())
            and t.untyped_storage().data_ptr() in self._storages
        )  # fmt: skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PRODUCTS or func in _BIASED:
            operands = args[1:3] if func in _BIASED else args[:2]
            if any(self._is_zero(t) for t in operands):
                out = func(*(_meta(a) for a in args), **kwargs)  # the product's shape and dtype
                zeros = torch.zeros(out.shape, dtype=out.dtype)
                if func in _BIASED:
                    zeros += kwargs.get("beta", 1) * args[0]
                return zeros
        if func is _aten.index.Tensor and self._is_zero(args[0]):
            out = func(_meta(args[0]), [_meta(i) for i in args[1]])
            if out.numel() >= _LARGE:
                return args[0].as_strided(out.shape, [0] * out.dim())  # the same zero element: still a zero weight
        return func(*args, **kwargs)


class _LargeOnMeta(TorchFunctionMode):
    """While the copy is built: a tensor created without a device and of at least ``_LARGE_INIT`` elements (a weight:
    an embedding, a stack of experts) is created on ``meta``, so that no weight is ever allocated on the host
    (tens of GB for one stack of experts); smaller ones (buffers) are created on the CPU with their values."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None and _numel(func, args) >= _LARGE_INIT:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _numel(func, args) -> int:
    size = args[0] if func is torch.full or (args and isinstance(args[0], (tuple, list, torch.Size))) else args
    try:
        return math.prod(int(n) for n in size)
    except (TypeError, ValueError):
        return 0


@contextlib.contextmanager
def cpu_probe(model, config) -> Iterator:
    """A copy of ``model``'s class built from ``config`` on the CPU with zero weights, in eval mode; its matrix
    products with those weights answered as zeros while the context is open."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False), _LargeOnMeta():  # parameters on meta, buffers on the CPU
        probe = type(model)(config)
    dtypes = {name: t.dtype for name, t in (*model.named_parameters(), *model.named_buffers())}
    # weights the real model ties (one parameter under several names) are one weight here too
    tied = {name: id(t) for name, t in model.named_parameters(remove_duplicate=False)}
    zeros: dict = {}
    for module_name, module in probe.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            key = tied.get(prefix + name, ("probe", id(param)))
            if key not in zeros:
                dtype = dtypes.get(prefix + name, model.dtype if param.is_floating_point() else param.dtype)
                weight = torch.zeros((), dtype=dtype).expand(param.shape)
                zeros[key] = torch.nn.Parameter(weight, requires_grad=False)
            module._parameters[name] = zeros[key]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtypes.get(prefix + name, model.dtype))
    with ZeroWeightProducts(zeros.values()):
        yield probe.eval()
