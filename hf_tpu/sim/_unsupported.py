"""What a PrivateUse1 backend written in Python cannot get from torch 2.13, made to work or refused in hf_tpu's words.

torch asks the PrivateUse1 hooks for a few services that ``torch._C._acc.PrivateUse1Hooks`` cannot provide from
Python (it exposes only ``is_available``, ``has_primary_context`` and ``is_built``); without this module each fails
with torch's internal "You should register `PrivateUse1HooksInterface` ..." message:

- ``torch.Generator(device="tpu")`` (``getNewGenerator``): torch.Generator becomes a thin class whose ``tpu``
  instances are the simulator's device generators (:class:`hf_tpu.sim._rng.DeviceGenerator`: a CPU generator's
  state reporting ``device == tpu:0``, with graph-safe state); the simulator's ops run their CPU kernels with it, so
  seeded sampling works as on torch_tpu (which has device generators). ``isinstance(g, torch.Generator)`` holds for
  every generator, C-made ones included.
- ``untyped_storage().resize_()`` on a device storage (``resizePrivateUse1Bytes``): the native core's C++ hooks
  reallocate it (``_native.cpp``); on the Python path a simulated storage is a view of a CPU buffer and cannot be
  reallocated in place: a clear NotImplementedError with the way around.
- sparse layouts (the ``SparsePrivateUse1``/``SparseCsrPrivateUse1`` keys have no kernels; torch_tpu supports
  strided tensors only): a clear NotImplementedError naming the op.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_tpu.sim._rng import DeviceGenerator

__all__ = ["install"]

_CGenerator = torch._C.Generator
_LIB: torch.library.Library | None = None


def _is_tpu(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return False  # torch.Generator(0) means cuda:0 / the current accelerator's index in torch's parser
    return torch.device(device).type == "tpu"


class _GeneratorMeta(type(_CGenerator)):  # type: ignore[misc]
    def __call__(cls, device: Any = "cpu") -> Any:
        if _is_tpu(device):
            from hf_tpu.sim._device_index import index_of_device

            index_of_device(device)
            if cls is not Generator:
                raise NotImplementedError(
                    f"{cls.__name__}(device={str(device)!r}): a subclass of torch.Generator cannot live on the "
                    "simulated tpu device; use torch.Generator('tpu') or a CPU generator."
                )
            return DeviceGenerator()
        if cls is not Generator:  # a user's subclass of torch.Generator: built as usual
            return super().__call__(device)
        return _CGenerator(device)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _CGenerator)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, _CGenerator)


class Generator(_CGenerator, metaclass=_GeneratorMeta):
    """``torch.Generator`` while the simulator is enabled: ``torch.Generator("tpu")`` works (see the module)."""


Generator.__module__ = "torch"
Generator.__qualname__ = Generator.__name__ = "Generator"


def _storage_resize(original: Any) -> Any:
    def resize_(self: torch.UntypedStorage, size: int) -> Any:
        from hf_tpu.sim._counters import STATE

        if self.device.type == "tpu" and STATE.native is None:
            raise NotImplementedError(
                f"untyped_storage().resize_({size}) is not supported on the simulated tpu device: a device storage "
                "cannot be reallocated in place by the simulator's Python path (torch gives Python backends no "
                "resizePrivateUse1Bytes; the native core, built where a C++ compiler is, provides it). "
                "Allocate a new tensor instead (torch.empty(n, device='tpu'), or tensor.resize_(shape), which "
                "works), or run this code on the CPU."
            )
        out = original(self, size)
        if self.device.type == "tpu":
            self.__dict__.pop("_hf_hvs", None)  # host views of the old memory (see _ops._host)
        return out

    resize_._hf_tpu_sim = True  # type: ignore[attr-defined]
    return resize_


def _sparse_fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        f"{op}: sparse tensors are not supported on the simulated tpu device (torch_tpu supports strided tensors "
        "only); keep sparse tensors on the CPU, or densify them first (t.to_dense().to('tpu'))."
    )


def install() -> None:
    """Patch ``torch.Generator`` and ``UntypedStorage.resize_`` (reversible), register the sparse refusals (once)."""
    global _LIB
    from hf_tpu._patch import patch

    if torch.Generator is not Generator:
        patch(torch, "Generator", Generator, feature="sim", package="torch", versions=">=2.11,<=2.15")
    resize = torch.UntypedStorage.resize_
    if not getattr(resize, "_hf_tpu_sim", False):
        patch(torch.UntypedStorage, "resize_", _storage_resize(resize), feature="sim", package="torch",
              versions=">=2.11,<=2.15")
    if _LIB is None:
        lib = torch.library.Library("_", "IMPL")
        lib.fallback(_sparse_fallback, "SparsePrivateUse1")
        lib.fallback(_sparse_fallback, "SparseCsrPrivateUse1")
        _LIB = lib
