"""Registers the simulated device with torch: PrivateUse1 renamed ``tpu``, ``torch.tpu``, ``torch.backends.tpu``.

When torch_tpu 0.2.0 is installed on a host without chips, its autoload registers ``torch.tpu`` and a dynamo
backend named ``"tpu"`` but leaves PrivateUse1 unnamed; :func:`register` then takes ``torch.tpu`` over (the
torch_tpu module is kept aside in ``TAKEN_OVER``) and the simulator's compile backend replaces its ``"tpu"``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch

from hf_tpu.sim import (
    _accelerator,
    _attention,
    _autocast,
    _device_index,
    _device_module,
    _native,
    _ops,
    _pinned,
    _public_api,
)
from hf_tpu.sim._after_import import after_import

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
    if "torch_tpu" in sys.modules and torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::empty.memory_format", "PrivateUse1"
    ):
        # torch-tpu's autoload (at `import torch`) registered its C++ kernels for PrivateUse1, catch-all and
        # autocast fallbacks included. Those cannot be unregistered, and they need real chips: on this host they
        # wait for the cloud metadata server, then crash. Refuse before changing anything.
        raise RuntimeError(
            "cannot enable the simulated tpu device: torch-tpu was autoloaded by `import torch` in this process and "
            "its kernels own the PrivateUse1 device (they need real TPU chips). Turn torch-tpu's autoload off before "
            "torch is imported: set TORCH_DEVICE_BACKEND_AUTOLOAD=0 in the environment, or set HF_TPU_SIMULATE=1 and "
            "`import hf_tpu` before `import torch` (hf-tpu --simulate does this for you)."
        )
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
    _public_api.install(_device_module)  # torch.tpu.distributed, .ops, .compiler, .pallas, ...
    native = _native.load()  # built on first use where a C++ compiler is (see docs/simulator.md)
    if native is not None:
        native.register_hooks()  # C++ hooks: also a pinned-memory allocator and storage resizing
    else:
        torch._C._acc.register_python_privateuseone_hook(_Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(_Guard())
    if not hasattr(torch.backends, "tpu") or not getattr(torch.backends.tpu, "simulated", False):
        if hasattr(torch.backends, "tpu"):
            TAKEN_OVER["torch.backends.tpu"] = torch.backends.tpu
        from hf_tpu import _patch

        _patch.assign(
            torch.backends, "tpu", _backends_module(), feature="sim",
            reason="the simulated device's torch.backends.tpu (torch_tpu's is taken over), for the process's life",
        )  # fmt: skip
        sys.modules["torch.backends.tpu"] = torch.backends.tpu
    _accelerator.install()  # torch.accelerator's memory and synchronize answers, with the device for its life
    _ops.install()
    _attention.install()
    _autocast.install()
    _pinned.install()
    patch_storage_to()
    patch_untyped_storage_new()
    after_import("torch._dynamo", _register_dynamo_interface)
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


def _storage_to_tpu(original):
    """torch's ``storage.to(device)`` allocates through the device's C++ allocator, which a Python backend
    cannot register (it segfaults); for ``tpu`` build the device storage over a CPU copy instead."""
    from hf_tpu.sim._counters import STATE
    from hf_tpu.sim._tensors import new_device_storage

    def _to(self, device, non_blocking=False):
        if isinstance(device, torch.device) and device.type == "tpu" and self.device.type == "cpu":
            _device_index.index_of_device(device)
            cpu = torch.UntypedStorage(self.nbytes())
            cpu.copy_(self)
            STATE.h2d_copies += 1
            STATE.h2d_bytes += self.nbytes()
            return new_device_storage(cpu, "storage.to('tpu')")
        return original(self, device, non_blocking)

    return functools.wraps(original)(_to)  # what torch can inspect of it stays torch's (tests/test_patch_contract.py)


def patch_storage_to() -> None:
    """Let ``torch.load(..., map_location="tpu")`` and ``storage.to("tpu")`` work (torch <= 2.13)."""
    import torch.storage

    from hf_tpu._patch import patch

    current = torch.storage._to
    if getattr(current, "__wrapped__", None) is not None:
        return
    patch(torch.storage, "_to", _storage_to_tpu(current), feature="sim", package="torch", versions=">=2.11,<=2.15")


def patch_untyped_storage_new() -> None:
    """``torch.UntypedStorage(n, device="tpu")`` would allocate through the missing PrivateUse1 allocator and
    segfault; give it a device storage over fresh CPU memory instead (torch <= 2.13)."""
    from hf_tpu._patch import patch
    from hf_tpu.sim._tensors import new_device_storage

    cls = torch.UntypedStorage
    current = cls.__dict__.get("__new__")
    if getattr(current, "_hf_tpu_sim", False):
        return
    base_new = torch._C.StorageBase.__new__

    def __new__(klass, *args, device=None, **kwargs):
        if device is None:
            return base_new(klass, *args, **kwargs)
        dev = device if isinstance(device, torch.device) else torch.device(device)
        if dev.type != "tpu":
            return base_new(klass, *args, device=device, **kwargs)
        _device_index.index_of_device(dev)
        if kwargs or len(args) > 1 or (args and not isinstance(args[0], int)):
            raise NotImplementedError(
                "torch.UntypedStorage(..., device='tpu') takes only a size in bytes on the simulated device; "
                "build the storage on the CPU and move a tensor over it with .to('tpu')"
            )
        return new_device_storage(cls(args[0] if args else 0), "torch.UntypedStorage(device='tpu')")

    __new__._hf_tpu_sim = True  # type: ignore[attr-defined]
    patch(cls, "__new__", __new__, feature="sim", package="torch", versions=">=2.11,<=2.15")
