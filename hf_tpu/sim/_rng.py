"""The simulated device's random generators, and graph-safe RNG for compiled graphs as torch-tpu 0.2.0 registers it.

torch_tpu's ``_internal/compile/__init__.py`` (``_initialize_graphsafe_rng``, run when its autoload imports the module,
where torch has ``register_graphsafe_rng_device_type``: torch >= 2.13) registers ``"privateuseone"`` as a graph-safe
RNG device type, adds ``"tpu"`` to the same set (torch_tpu renames PrivateUse1), and sets
``torch._functorch.config.graphsafe_rng_functionalization = True`` and ``functionalize_rng_ops = False``.
:func:`install` does the same when the simulator is enabled (tests/contract/test_graphsafe_rng.py holds it to the
wheel's function); ``hf_tpu.disable()`` puts the two flags and the device-type set back as they were. The
registration's dispatch part (torch's ``graphsafe_run_with_rng_state`` kernel for ``PrivateUse1``) is made once per
process: torch offers no way to remove it, and it is unreachable while no graph-safe device type maps to
PrivateUse1 (the partitioner emits the op only for registered device types, and refuses others at run time).

What it is for: a random op that a compiled training step recomputes in its backward (dropout under
``torch.utils.checkpoint``) must draw the same numbers twice. With the device registered, AOTAutograd's partitioner
gives the forward and the backward graph each a generator (``fwd_rng_state_i``/``bwd_rng_state_i``, clones of the
device's default generator seeded alike from the CPU generator when the step first runs) and runs the op under
``graphsafe_run_with_rng_state``, which points the device generator at that state for the op. Without it, torch
falls back to ``run_and_save_rng_state``, which has no PrivateUse1 kernel: the compiled step fails on its first run
with ``AssertionError: Backend not supported for tpu``.

torch's contract (``register_graphsafe_rng_device_type``'s docstring): ``torch.tpu._get_generator(device)``
returns the default generator, which implements ``graphsafe_get_state()``, ``graphsafe_set_state(state)`` and
``clone_state()``; ``torch.tpu.get_rng_state(idx)`` and ``torch.tpu.default_generators`` exist. A CPU
``torch.Generator`` implements none of the three, so the device's generators are :class:`DeviceGenerator`, with
CUDA's semantics (the reference): ``graphsafe_set_state(g)`` makes the generator draw from and advance ``g``'s
state, ``graphsafe_get_state()`` returns a generator sharing the state in force, ``clone_state()`` an independent
copy. The simulator's random kernels draw from the state in force (:func:`in_force`).

On a chip, torch_tpu's compiled executable (``torch_tpu_compiled_executable.py``) runs such a graph with the device
state of the device's *default* generator for every generator input and writes it back afterwards; how its compiler
then keeps a recomputed backward's draws equal to the forward's cannot be seen without a chip. The simulator follows
torch's reference semantics above.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GENERATOR", "DeviceGenerator", "in_force", "install", "installed", "uninstall"]

_CGenerator = torch._C.Generator


class DeviceGenerator(_CGenerator):
    """A generator of the simulated ``tpu`` device: a CPU generator's state (the device's kernels run on the CPU),
    reporting ``tpu:0``, with graph-safe state as CUDA's generators have.

    Its own (C) state is its home state; ``graphsafe_set_state`` points it at another generator's home state, which
    its draws (through the simulator's kernels) and ``manual_seed``/``get_state``/``set_state`` then use and advance.

    Example:
        >>> import torch, hf_tpu.sim
        >>> g = torch.Generator("tpu").manual_seed(0)
        >>> other = g.clone_state().manual_seed(1)
        >>> saved = g.graphsafe_get_state()
        >>> g.graphsafe_set_state(other)      # g now draws from (and advances) other's state
        >>> g.initial_seed(), other.initial_seed()
        (1, 1)
        >>> g.graphsafe_set_state(saved)      # back to its own
        >>> g.initial_seed()
        0
    """

    def __init__(self) -> None:
        super().__init__()
        self._cell: _CGenerator = self  # the generator whose (C) state is in force: itself, or another's home

    @classmethod
    def _sharing(cls, cell: _CGenerator) -> DeviceGenerator:
        gen = cls()
        gen._cell = cell
        return gen

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("tpu", 0)  # not a module constant: "tpu" names a device once the simulator registers it

    def __repr__(self) -> str:
        return "<torch.Generator object on tpu:0 (simulated)>"

    def __reduce__(self) -> Any:
        return _rebuild, (self.get_state(),)

    def manual_seed(self, seed: Any) -> DeviceGenerator:  # type: ignore[override]
        _CGenerator.manual_seed(self._cell, seed)
        return self

    def seed(self) -> int:
        return _CGenerator.seed(self._cell)

    def initial_seed(self) -> int:
        return _CGenerator.initial_seed(self._cell)

    def get_state(self) -> torch.Tensor:
        return _CGenerator.get_state(self._cell)

    def set_state(self, new_state: torch.Tensor) -> DeviceGenerator:  # type: ignore[override]
        _CGenerator.set_state(self._cell, new_state)
        return self

    def graphsafe_get_state(self) -> DeviceGenerator:  # type: ignore[override]
        """A generator sharing the state in force: its draws advance this generator's state too."""
        return DeviceGenerator._sharing(self._cell)

    def graphsafe_set_state(self, state: Any) -> None:  # type: ignore[override]
        """Draw from (and advance) ``state``'s state from now on, as CUDA's generators do."""
        if not isinstance(state, DeviceGenerator):
            raise RuntimeError(
                f"graphsafe_set_state() of a tpu generator takes a tpu generator, got {state!r}: pass one of "
                "torch.tpu.default_generators, torch.Generator('tpu'), or what their graphsafe_get_state() or "
                "clone_state() returned."
            )
        self._cell = state._cell

    def clone_state(self) -> DeviceGenerator:  # type: ignore[override]
        """A new generator with an independent copy of the state in force."""
        clone = DeviceGenerator()
        _CGenerator.set_state(clone, self.get_state())
        return clone


def _rebuild(state: torch.Tensor) -> DeviceGenerator:
    return DeviceGenerator().set_state(state)


def in_force(generator: Any) -> Any:
    """The CPU generator a kernel draws from for ``generator`` (a device generator's state in force; others as is)."""
    return generator._cell if isinstance(generator, DeviceGenerator) else generator


# The device's default generator (torch_tpu keeps its own; torch.manual_seed seeds it through torch.tpu). Seeded from
# the host's entropy when it is made, as torch-tpu 0.2.0 seeds each device's default generator once per process
# (DeviceGenerators::GetEagerDefaultGenerator calls InitDefaultGenerator with c10::detail::getNonDeterministicRandom()
# in csrc/common/glue_*/libpywrap_*_common.so) and as torch seeds the CPU's: unseeded sampling differs between
# processes, torch.manual_seed makes it repeat. (A new torch.Generator starts at a fixed seed, 67280421310721.)
GENERATOR = DeviceGenerator()
GENERATOR.seed()

_FLAGS = ("graphsafe_rng_functionalization", "functionalize_rng_ops")  # torch._functorch.config's, as the wheel sets
_WHY = "a torch config module's flag (not in its __dict__, so patch() could not restore it); undone by uninstall()"
_SAVED: dict[str, Any] = {}  # what install() changed: the device-type set's additions and the flags' old values


def installed() -> bool:
    """True while the simulated device is registered for graph-safe RNG."""
    return bool(_SAVED)


def install() -> None:
    """Register the simulated device for graph-safe RNG as torch_tpu's ``_initialize_graphsafe_rng`` does
    (idempotent; ``hf_tpu.disable()`` undoes it, except the once-per-process dispatch registration)."""
    from torch._functorch import config
    from torch._functorch._aot_autograd import utils as aot_utils

    if _SAVED or not hasattr(aot_utils, "register_graphsafe_rng_device_type"):
        return  # torch < 2.13 has no graph-safe RNG for other devices; the wheel registers nothing there either
    from hf_tpu import _patch

    types = aot_utils._GRAPHSAFE_RNG_DEVICE_TYPES
    _SAVED["added"] = {"privateuseone", "tpu"} - types
    for flag in _FLAGS:
        _SAVED[flag] = getattr(config, flag)
    aot_utils.register_graphsafe_rng_device_type("privateuseone")
    types.add("tpu")  # torch_tpu renames privateuseone to tpu; so does the simulator
    for flag, value in zip(_FLAGS, (True, False), strict=True):
        _patch.assign(config, flag, value, feature="sim", reason=_WHY)
    _patch.on_revert("sim", uninstall)


def uninstall() -> None:
    """Put the device-type set and the two flags back as they were before :func:`install`."""
    from torch._functorch import config
    from torch._functorch._aot_autograd import utils as aot_utils

    if not _SAVED:
        return
    from hf_tpu import _patch

    aot_utils._GRAPHSAFE_RNG_DEVICE_TYPES.difference_update(_SAVED["added"])
    for flag in _FLAGS:
        _patch.assign(config, flag, _SAVED[flag], feature="sim", reason=_WHY)  # (not delattr: a config module)
    _SAVED.clear()
