"""The simulated ``tpu`` device: the same code as on a TPU, on CPU memory, with counters.

Importing this module enables the simulator (so ``TRANSFORMERS_TEST_BACKEND=hf_tpu.sim`` works); so does
``HF_TPU_SIMULATE=1`` at ``import hf_tpu``. Tensors live in ``tpu:0``; mixing them with CPU tensors raises
torch's usual same-device error; transfers, host syncs, compiles and new eager shape signatures are counted.

The simulator raises the built-in exceptions torch_tpu's wheel raises, type for type (``RuntimeError``,
``ValueError``, ``TypeError``, ``NotImplementedError``, ``AttributeError``, ``ImportError``), not hf_tpu's classes,
so code tested here catches on a TPU what it caught on the simulator; its own checks (:func:`enable`'s arguments,
:func:`host_view`, the native core) raise built-ins too, like the device around them. :class:`SimStrictError`
(strict mode) is its one class of its own.

Example:
    >>> import torch, hf_tpu.sim
    >>> hf_tpu.sim.enable(generation="v6e")
    >>> x = torch.randn(2, 3).to("tpu")
    >>> with hf_tpu.sim.stats() as s:
    ...     y = (x @ x.T).relu().cpu()
    >>> x.device.type, s.d2h_copies
    ('tpu', 1)
"""

from __future__ import annotations

import importlib.metadata

from hf_tpu.sim import execution_mode  # torch_tpu's CPU-fallback switch, mirrored
from hf_tpu.sim._after_import import after_import
from hf_tpu.sim._counters import STATE, SimStrictError, Stats, stats, strict
from hf_tpu.sim._tensors import host_view, is_sim_tensor

__all__ = [
    "SimStrictError",
    "Stats",
    "enable",
    "execution_mode",
    "forget_shapes",
    "host_reads",
    "host_view",
    "is_enabled",
    "is_sim_tensor",
    "max_memory_allocated",
    "memory_allocated",
    "native_status",
    "reset_peak",
    "stats",
    "strict",
]

_ENABLED: dict[str, object] = {}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def enable(generation: str = "v6e", hbm: int | None = None, emulate_precision: bool = True) -> None:
    """Register the simulated ``tpu`` device in this process (idempotent; a new call reconfigures it).

    Args:
        generation: a TPU generation preset of :data:`hf_tpu.runtime.GENERATIONS` (``"v5e"``, ``"v5p"``,
            ``"v6e"``, ``"v7"``, ...): sets the device name and its HBM.
        hbm: HBM of the device in bytes, overriding the preset (tests use small values to provoke OOM).
        emulate_precision: compute as a chip does (the default): float32 matmuls, convolutions and attention run
            at the TPU precision that ``torch.set_float32_matmul_precision`` / ``torch.tpu.precision`` select
            (``'medium'``, torch_tpu's default: one bfloat16 pass; ``'high'``: bf16x3; ``'highest'``: float32), so
            outputs drift from the CPU's as on a chip. False: they compute in float32 like the CPU at every setting.
            The initial precision is ``'medium'``, or ``HF_TPU_SIM_MATMUL_PRECISION`` when set (docs/simulator.md).

    Raises:
        RuntimeError: this host has real TPU chips (use torch_tpu), or PrivateUse1 belongs to another backend.
        ValueError: unknown generation, or a bad ``HF_TPU_SIM_MATMUL_PRECISION``.

    Example:
        >>> import hf_tpu.sim
        >>> hf_tpu.sim.enable(generation="v5e", hbm=2 * 1024**3)
        >>> import torch; torch.tpu.get_device_properties().total_memory
        2147483648
    """
    from hf_tpu import runtime

    if generation not in runtime.GENERATIONS:
        raise ValueError(
            f"unknown TPU generation {generation!r} for the simulator; known: {', '.join(runtime.GENERATIONS)}"
        )
    chips, found = runtime.scan_pci_chips()
    if chips:
        raise RuntimeError(
            f"refusing to simulate a TPU: this host has {chips} real TPU chip(s) ({found}). Use them through "
            "torch_tpu (pip install 'hf-tpu[tpu]') and unset HF_TPU_SIMULATE / drop --simulate."
        )
    spec = runtime.GENERATIONS[generation]
    hbm_bytes = int(hbm) if hbm is not None else int(spec["hbm_per_chip"]) // int(spec["devices_per_chip"])
    if hbm_bytes <= 0:
        raise ValueError(f"hbm must be a positive number of bytes, got {hbm!r}")

    from hf_tpu.sim import (
        _accelerator,
        _backend,
        _compile,
        _device,
        _device_module,
        _meta_kernels,
        _precision,
        _rng,
        _unsupported,
    )

    _device.register()
    _device.patch_storage_to()  # again, in case hf_tpu.disable() reverted them
    _device.patch_untyped_storage_new()
    _compile.install()
    _meta_kernels.install()  # torch_tpu's meta kernels for compile (removed by hf_tpu.disable())
    _rng.install()  # torch_tpu's graph-safe RNG registration for compile (undone by hf_tpu.disable())
    _accelerator.forget_cached_checks()
    _unsupported.install()
    _precision.install()
    _precision.set_emulation(emulate_precision)
    after_import("torch._dynamo", _backend.register)  # importing dynamo costs seconds: wait until it is used
    name = f"{spec['name']} (simulated)"
    _device_module._configure(name, hbm_bytes)
    STATE.hbm_bytes = hbm_bytes
    _ENABLED.update(generation=generation, hbm=hbm_bytes, emulate_precision=bool(emulate_precision))
    runtime._set_simulated(
        runtime.RuntimeInfo(
            mode="simulated",
            device_count=1,
            chips_on_host=0,
            hbm_bytes=hbm_bytes,
            generation=generation,
            torch_tpu_version=_version("torch-tpu") or _version("torch_tpu"),
            libtpu_version=_version("libtpu"),
            reason=f"simulated {spec['name']} with {hbm_bytes / 1024**3:.2f} GiB HBM (hf_tpu.sim, CPU memory)",
        ),
        distributed=DistributedSide,
    )


class DistributedSide:
    """The simulator's side of ``torch.distributed``, handed to :func:`hf_tpu.runtime.simulated_distributed` by
    :func:`enable`: code outside the simulator (``hf-tpu launch``'s ranks, the tensor-parallel mesh) calls it there
    and never imports the simulator."""

    @staticmethod
    def register() -> None:
        """Register the simulated ``tpu_dist`` process-group backend (:func:`hf_tpu.sim.process_group.register`)."""
        from hf_tpu.sim import process_group

        process_group.register()

    @staticmethod
    def prepare_rank() -> None:
        """A rank of ``hf-tpu launch --simulate`` (its ``hf_tpu`` import enabled the device): the generation and HBM
        the launcher was asked to simulate (``HF_TPU_SIM_GENERATION``, ``HF_TPU_SIM_HBM``), then :meth:`register`.

        Raises:
            ValueError: an unknown generation or a bad HBM size (see :func:`enable`).
        """
        from hf_tpu import _env

        generation, hbm = _env.SIM_GENERATION.get(), _env.SIM_HBM.get()
        if generation or hbm:
            enable(**({"generation": generation} if generation else {}), hbm=hbm)
        DistributedSide.register()


def is_enabled() -> bool:
    """Whether the simulated device is registered.

    Returns:
        True once :func:`enable` ran in this process.
    """
    return bool(_ENABLED)


def memory_allocated() -> int:
    """Simulated device memory in use.

    Returns:
        The bytes of simulated device memory held by live tensors now.
    """
    return STATE.live_bytes


def max_memory_allocated() -> int:
    """Peak simulated device memory.

    Returns:
        The most bytes of simulated device memory held at once since the start or the last :func:`reset_peak`.
    """
    return STATE.peak_bytes


def reset_peak() -> None:
    """Restart :func:`max_memory_allocated` from the current live bytes."""
    STATE.peak_bytes = STATE.live_bytes


if not _ENABLED:
    enable()


def forget_shapes() -> None:
    """Forget the eager op shapes seen so far, as a new process would (the next call of each counts as a new
    signature, i.e. an op compile on torch_tpu); compiled graphs are forgotten with ``torch._dynamo.reset()``."""
    STATE.seen.clear()


def host_reads() -> list[str]:
    """The source lines at which graphs compiled by the simulator's ``"tpu"`` backend read a device value on the host
    (``.item()``, ``.tolist()``, a check on a tensor: ``aten._local_scalar_dense``), one per such graph, in compile
    order, since the process started. torch_tpu 0.2.0 refuses to lower such a graph ("local_scalar_dense(): cannot
    record EventSnapshot during an FX trace"), and the simulator refuses it alike: each site is that of a refused
    graph (a boolean-mask index or an assignment of a row per masked position counts too).

    Returns:
        A new list of ``"File ..., line N, in fn <source>"`` strings (empty when no compiled graph read the host).
    """
    from hf_tpu.sim import _backend

    return list(_backend.HOST_READS)


def native_status() -> str:
    """Whether the simulator's native (C++) core serves the device's ops.

    Returns:
        ``'on'``, ``'off (...)'``, ``'unavailable (...)'`` or ``'not loaded'``, the parentheses giving the reason.
    """
    from hf_tpu.sim import _native

    return _native.status()
