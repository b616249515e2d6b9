"""Registers the simulated device with torch: PrivateUse1 renamed ``tpu``, ``torch.tpu``, ``torch.backends.tpu``.

When torch_tpu 0.2.0 is installed on a host without chips, its autoload registers ``torch.tpu`` and a dynamo
backend named ``"tpu"`` but leaves PrivateUse1 unnamed; :func:`register` then takes ``torch.tpu`` over (the
torch_tpu module is kept aside in ``TAKEN_OVER``) and the simulator's compile backend replaces its ``"tpu"``.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

from hf_tpu.sim import _autocast, _device_module, _ops

__all__ = ["register"]

TAKEN_OVER: dict[str, object] = {}
_REGISTERED = False


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def _backends_module() -> types.ModuleType:
    mod = types.ModuleType("torch.backends.tpu", "Simulated TPU backend flags (hf_tpu.sim).")
    mod.is_available = lambda: True  # type: ignore[attr-defined]
    mod.is_built = lambda: True  # type: ignore[attr-defined]
    mod.simulated = True  # type: ignore[attr-defined]
    return mod


def register() -> None:
    """Name PrivateUse1 ``tpu`` and install the device module, hooks, guard and aten fallback (once)."""
    global _REGISTERED
    if _REGISTERED:
        return
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", "tpu"):
        raise RuntimeError(
            f"cannot register the simulated tpu device: PrivateUse1 is already taken by {current!r} in this process"
        )
    if current == "privateuseone":
        torch.utils.rename_privateuse1_backend("tpu")
    if not hasattr(torch.Tensor, "is_tpu"):
        torch.utils.generate_methods_for_privateuse1_backend()
    existing = getattr(torch, "tpu", None)
    if existing is not None and existing is not _device_module:
        TAKEN_OVER["torch.tpu"] = existing
        delattr(torch, "tpu")
    if getattr(torch, "tpu", None) is None:
        torch._register_device_module("tpu", _device_module)
    sys.modules["torch.tpu"] = _device_module
    torch._C._acc.register_python_privateuseone_hook(_Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(_Guard())
    if not hasattr(torch.backends, "tpu") or not getattr(torch.backends.tpu, "simulated", False):
        if hasattr(torch.backends, "tpu"):
            TAKEN_OVER["torch.backends.tpu"] = torch.backends.tpu
        torch.backends.tpu = _backends_module()  # type: ignore[attr-defined]
        sys.modules["torch.backends.tpu"] = torch.backends.tpu
    _ops.install()
    _autocast.install()
    _register_dynamo_interface()
    _REGISTERED = True


def _register_dynamo_interface() -> None:
    from torch._dynamo import device_interface as di

    class SimTpuInterface(di.TpuInterface):  # type: ignore[misc, valid-type]
        @staticmethod
        def is_available() -> bool:
            return True

        @staticmethod
        def device_count() -> int:
            return 1

        @staticmethod
        def synchronize(device: object = None) -> None:
            pass

        @staticmethod
        def current_device() -> int:
            return 0

        @staticmethod
        def set_device(device: object) -> None:
            pass

    with contextlib.suppress(NotImplementedError, RuntimeError):
        di.get_interface_for_device("tpu")  # lets torch register its own interfaces first
    di.register_interface_for_device("tpu", SimTpuInterface)
