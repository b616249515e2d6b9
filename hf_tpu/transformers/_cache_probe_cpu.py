"""The cache probe's fallback: a real run on the CPU of a copy of the model whose weights take no memory.

Some models read a tensor's value in their forward even given embeddings: a padding check (``mask.all()`` in the
masks of BigBird, MegatronBERT, RemBERT), an expert loop over the routing result (``expert_size.tolist()`` in
JetMoE, ``expert_idx.item()`` in LongCat-Flash). The ``meta`` device has no values, so
:mod:`~hf_tpu.transformers._cache_probe` runs such a model here instead: its class, built from the same config
(every size kept: the cache shapes are exactly what the real model writes, layer by layer), on the CPU, with real
values. Its buffers are computed as the class computes them (rotary frequencies, position ids); each parameter is a
zero broadcast from one element in the real model's dtype for it, so a model of any size costs a few bytes per
parameter, and a matrix product with such a weight is answered as the zeros it is (:class:`_ZeroWeightProducts`)
instead of being materialized. Nothing runs on the TPU, and the real model is only read for its parameter dtypes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__: list[str] = []


def _is_zero_weight(t) -> bool:
    """Whether ``t`` is a zero weight of the copy: a tensor with more than one element and every stride 0."""
    import torch

    return isinstance(t, torch.Tensor) and t.numel() > 1 and not any(t.stride())


def _zero_products():
    from torch.utils._python_dispatch import TorchDispatchMode

    import torch

    aten = torch.ops.aten
    products = {aten.mm.default, aten.bmm.default}  # the product with a zero weight is zero
    biased = {aten.addmm.default, aten.baddbmm.default}  # beta * input + alpha * product: beta * input

    class _ZeroWeightProducts(TorchDispatchMode):
        """Matrix products and gathers of the copy's zero weights, answered without materializing the weight
        (CPU BLAS would copy a broadcast operand into a dense one first: the lm_head alone is gigabytes)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            operands = args[1:3] if func in biased else args[:2]
            if func in products | biased and any(_is_zero_weight(t) for t in operands):
                out = func(*(_meta(a) for a in args), **kwargs)  # the result's shape and dtype
                zeros = torch.zeros(out.shape, dtype=out.dtype)
                if func in biased:
                    zeros += kwargs.get("beta", 1) * args[0]
                return zeros
            if func is aten.index.Tensor and _is_zero_weight(args[0]):
                out = func(_meta(args[0]), [_meta(i) for i in args[1]], **kwargs)  # an expert's weights, gathered
                return torch.zeros((), dtype=out.dtype).expand(out.shape)
            return func(*args, **kwargs)

    return _ZeroWeightProducts()


def _meta(value):
    import torch

    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


@contextlib.contextmanager
def cpu_probe(model, config) -> Iterator:
    """A copy of ``model``'s class built from ``config`` on the CPU with zero weights, in eval mode; its matrix
    products with those weights answered as zeros while the context is open."""
    import torch
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers computed on the CPU
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
    with _zero_products():
        yield probe.eval()
