"""The one place hf_tpu reads torch_tpu's private modules (written against torch-tpu 0.2.0).

torch-tpu keeps the facts hf_tpu needs behind ``torch_tpu._internal``: the TPU generations, their PCI device ids,
HBM per chip and devices per chip, and the chip counts each generation accepts with their mesh
(``_internal/utils/hardware.py``); the launch environment (``_internal/distributed/distributed.py:
set_tpu_launch_env``); the list of public ``torch.tpu`` names (``_internal/public_api.py``). Every read of them
goes through this module, so the surface hf_tpu depends on is listed here (:data:`EXPECTED_NAMES`), checked by
``hf-tpu selftest`` on a TPU VM (:func:`missing_names`) and by ``tests/contract`` against the real wheel.

torch_tpu's compilation cache is configured and observed here too: :func:`point_compile_cache` sets its tier-2
name and tier-3 root from hf_tpu's ``cache_dir``, :func:`cache_tiers` says where each tier lives, and
:func:`cache_stats` reads its counters (``torch.tpu._get_cache_stats()``; the simulator answers the same call).

When torch-tpu is installed, :func:`generations` reads its hardware tables: the module is loaded from the wheel's
file on its own, without importing the ``torch_tpu`` package (which would load libtpu), unless torch_tpu is
already imported. Without torch-tpu, the copy below is used; ``tests/contract`` keeps it equal to the wheel.

Example:
    >>> from hf_tpu import _torch_tpu
    >>> _torch_tpu.generations()["v6e"].topologies
    {1: '1,1,1', 4: '2,2,1', 8: '2,4,1'}
    >>> _torch_tpu.topology("v5p", 2)
    '1,2,1'
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from hf_tpu.errors import UnsupportedError, UserError

__all__ = [
    "EXPECTED_NAMES",
    "TIER2_ENV",
    "TIER3_ENV",
    "CacheStats",
    "cache_stats",
    "cache_tiers",
    "point_compile_cache",
    "tier2_name",
    "WRITTEN_FOR",
    "LOWERING_NAMES",
    "DYNAMIC_NAMES",
    "LoweredProgram",
    "LoweringSession",
    "LoweringUnavailableError",
    "start_lowering",
    "Generation",
    "UnsupportedTopologyError",
    "generations",
    "installed_version",
    "missing_names",
    "set_tpu_launch_env",
    "source",
    "topology",
    "valid_counts",
]

WRITTEN_FOR = "0.2.0"

HARDWARE_MODULE = "torch_tpu._internal.utils.hardware"
LAUNCH_MODULE = "torch_tpu._internal.distributed.distributed"
PUBLIC_API_MODULE = "torch_tpu._internal.public_api"

GiB = 1024**3

# hf_tpu's copy of torch-tpu 0.2.0's hardware tables (hardware.py), for hosts without torch-tpu.
# key: (name, PCI device id, HBM bytes per chip, devices per chip, chip count -> "x,y,z" mesh)
_COPY: dict[str, tuple[str, str, int, int, dict[int, str]]] = {
    "v4": ("TPU v4", "0x005e", 32 * GiB, 1, {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,2,2"}),
    "v5p": ("TPU v5p", "0x0062", 95 * GiB, 1, {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,2,2"}),
    "v5e": ("TPU v5e", "0x0063", 16 * GiB, 1, {1: "1,1,1", 4: "2,2,1", 8: "2,4,1"}),
    "v6e": ("TPU v6e", "0x006f", 32 * GiB, 1, {1: "1,1,1", 4: "2,2,1", 8: "2,4,1"}),
    "v7": ("TPU v7", "0x0076", 192 * GiB, 2, {2: "1,1,1,2", 4: "1,2,1,2", 8: "2,2,1,2"}),
}
GOOGLE_PCI_VENDOR = "0x1ae0"

# torch-tpu 0.2.0's words when it refuses, while lowering, a graph that reads a device value on the host, after the op it
# met ("local_scalar_dense(): " for .item()/.tolist()/a tensor check, "nonzero(): " for a boolean-mask index,
# "index_put_(): " for an assignment of a row per masked position), raised out of torch.compile as
# BackendCompilerFailed (tests/contract: lower_host_reads). The simulator refuses such graphs with the same words.
HOST_READ_REFUSED = "cannot record EventSnapshot during an FX trace"

# Every torch_tpu name hf_tpu reads: module -> attributes. ``torch.tpu`` lists the public names real-mode code
# calls (checked in torch_tpu's public API table); ``torch.accelerator`` the torch entry points used instead of
# torch.tpu's internal ones (device_count, synchronize, memory).
EXPECTED_NAMES: dict[str, tuple[str, ...]] = {
    HARDWARE_MODULE: (
        "_GOOGLE_PCI_VENDOR_ID",
        "_TOPOLOGY_BY_TPU_PCI_DEVICE_ID",
        "_PCI_DEVICE_ID_TO_NAME",
        "_HBM_BYTES_PER_CHIP",
        "_DEVICES_PER_CHIP",
        "TpuVersion",
        "get_tpu_topology",
    ),
    LAUNCH_MODULE: ("set_tpu_launch_env",),
    PUBLIC_API_MODULE: ("_PUBLIC_MODULES",),
    "torch.tpu": ("get_device_properties", "get_device_name"),
    "torch.tpu.distributed": ("set_tpu_launch_env",),
    "torch.accelerator": ("current_accelerator", "device_count", "synchronize", "get_memory_info", "memory_allocated"),
}


class UnsupportedTopologyError(UserError, ValueError):
    """A chip count that torch_tpu has no mesh for on this TPU generation (its ``get_tpu_topology`` raises)."""


@dataclass(frozen=True)
class Generation:
    """One TPU generation as torch_tpu describes it."""

    key: str  # "v6e"
    name: str  # "TPU v6e", what torch.tpu.get_device_name() returns
    pci_id: str  # PCI device id, "0x006f"
    hbm_per_chip: int  # bytes
    devices_per_chip: int  # devices one chip exposes (v7: 2); torch_tpu's PCI scan counts devices
    topologies: dict[int, str]  # devices on one host -> mesh string

    @property
    def hbm_per_device(self) -> int:
        return self.hbm_per_chip // self.devices_per_chip


def installed_version() -> str | None:
    """The installed torch-tpu version, read from package metadata (nothing is imported)."""
    for name in ("torch-tpu", "torch_tpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _package_dir() -> Path | None:
    if "torch_tpu" in sys.modules:
        return Path(sys.modules["torch_tpu"].__file__).parent
    try:
        spec = importlib.util.find_spec("torch_tpu")  # finds a top-level package without running its __init__
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def _hardware() -> ModuleType | None:
    """torch_tpu's hardware module: the imported one, or its file loaded alone (no libtpu); None without it."""
    if HARDWARE_MODULE in sys.modules:
        return sys.modules[HARDWARE_MODULE]
    root = _package_dir()
    path = root / "_internal" / "utils" / "hardware.py" if root else None
    if path is None or not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("hf_tpu._torch_tpu_hardware", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports only the standard library and immutabledict
    return module


def _key(name: str) -> str:
    """``"TPU v6e"`` -> ``"v6e"``."""
    return name.removeprefix("TPU").strip()


def _from_wheel(hw: ModuleType) -> dict[str, Generation]:
    by_name = {v.value: v for v in hw.TpuVersion}
    found = {}
    for pci_id, name in hw._PCI_DEVICE_ID_TO_NAME.items():
        version = by_name[name]
        found[_key(name)] = Generation(
            key=_key(name),
            name=name,
            pci_id=pci_id,
            hbm_per_chip=int(hw._HBM_BYTES_PER_CHIP[version]),
            devices_per_chip=int(hw._DEVICES_PER_CHIP.get(version, 1)),
            topologies=dict(sorted(hw._TOPOLOGY_BY_TPU_PCI_DEVICE_ID[pci_id].items())),
        )
    return found


def copied_generations() -> dict[str, Generation]:
    """hf_tpu's copy of the tables (used where torch-tpu is not installed)."""
    return {k: Generation(k, n, pci, hbm, per, dict(topo)) for k, (n, pci, hbm, per, topo) in _COPY.items()}


@functools.cache
def generations() -> dict[str, Generation]:
    """TPU generations by key (``"v6e"``): from the installed torch-tpu, else hf_tpu's copy of 0.2.0's tables."""
    try:
        hw = _hardware()
    except ImportError:  # a broken torch-tpu install (immutabledict missing): the copy still describes 0.2.0
        hw = None
    return _from_wheel(hw) if hw is not None else copied_generations()


def source() -> str:
    """Where :func:`generations` comes from, for reports: ``"torch-tpu 0.2.0"`` or ``"hf_tpu's copy of ..."``."""
    try:
        wheel = _hardware() is not None
    except ImportError:
        wheel = False
    return f"torch-tpu {installed_version()}" if wheel else f"hf_tpu's copy of torch-tpu {WRITTEN_FOR}'s tables"


def valid_counts(generation: str) -> tuple[int, ...]:
    """The device counts per host torch_tpu accepts on ``generation`` (``(1, 4, 8)`` on v6e)."""
    return tuple(generations()[generation].topologies)


def topology(generation: str, count: int) -> str:
    """The ``TORCH_TPU_TOPOLOGY`` torch_tpu sets for ``count`` devices of ``generation`` on one host.

    Raises:
        UnsupportedTopologyError: torch_tpu has no mesh for that count (its ``get_tpu_topology`` raises), with
            the counts that work.
    """
    gen = generations()[generation]
    if count not in gen.topologies:
        by_gen = "; ".join(f"{g.key}: {', '.join(map(str, g.topologies))}" for g in generations().values())
        raise UnsupportedTopologyError(
            f"{count} process(es) per host on {gen.name}: torch_tpu runs {gen.key} with "
            f"{', '.join(map(str, gen.topologies))} device(s) per host only (per generation: {by_gen}). "
            f"Pass --nproc_per_node={min(gen.topologies, key=lambda n: (abs(n - count), n))} or another count "
            "from that list."
        )
    return gen.topologies[count]


def set_tpu_launch_env(*, nnodes: int | None = None, nproc_per_node: int | None = None) -> None:
    """torch_tpu's own ``set_tpu_launch_env`` (imports the torch_tpu package: call it only in a real launch)."""
    module = importlib.import_module(LAUNCH_MODULE)
    module.set_tpu_launch_env(nnodes=nnodes, nproc_per_node=nproc_per_node)


def _public_exports(module: str) -> set[str] | None:
    try:
        api = importlib.import_module(PUBLIC_API_MODULE)
    except ImportError:
        return None
    spec = api._PUBLIC_MODULES.get(module)
    return set(spec.exports) if spec is not None else set()


def missing_names() -> list[str]:
    """The names of :data:`EXPECTED_NAMES` the installed torch-tpu (and torch) lack; ``[]`` when all are there.

    Reads module attributes and torch_tpu's public API table; initialises no device. Without torch-tpu only the
    ``torch.accelerator`` names are checked.
    """
    missing = []
    have_wheel = installed_version() is not None
    for module, names in EXPECTED_NAMES.items():
        if module.startswith("torch.tpu"):
            if not have_wheel:
                continue
            exports = _public_exports(module)
            missing += [f"{module}.{n}" for n in names if exports is None or n not in exports]
            continue
        if module.startswith("torch_tpu") and not have_wheel:
            continue
        try:
            obj = _hardware() if module == HARDWARE_MODULE else importlib.import_module(module)
        except ImportError as err:
            missing.append(f"{module} ({err})")
            continue
        missing += [f"{module}.{n}" for n in names if obj is None or not hasattr(obj, n)]
    return missing


# torch_tpu's compilation cache (0.2.0). Tier 1 is in the process's memory. Tier 2 is per host, in shared memory:
# TIER2_ENV holds a *name*, the cache lives in TIER2_ROOT/<name> (gone after a VM restart); "disabled" turns it off,
# unset means off at world size 1 and "default" above. Tier 3 is persistent and shareable: TIER3_ENV holds a *path*
# (local or gs://), off when unset. torch_tpu's C++ runtime reads both once, before its first compile (names and
# the /dev/shm path: strings of the glue library csrc/common/glue_<torch>/libpywrap_<torch>_common.so; meaning:
# torch_tpu/common/env_vars.h and docs/notebooks/environment_variables.py in torch_tpu's repository).
TIER2_ENV = "TORCH_TPU_TIER2_COMPILATION_CACHE"
TIER3_ENV = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"
TIER2_ROOT = "/dev/shm/torch_tpu_cache"
TIER2_DISABLED = "disabled"
TIER3_SUBDIR = "torch_tpu"  # hf_tpu's cache_dir/<this> is the tier-3 root it sets


def tier2_name(cache_root: str | os.PathLike) -> str:
    """The tier-2 cache name hf_tpu gives torch_tpu for ``cache_root``: a plain name (no ``/``), one per cache."""
    resolved = str(Path(cache_root).expanduser().resolve())
    return "hf_tpu-" + hashlib.sha256(resolved.encode()).hexdigest()[:16]


def point_compile_cache(cache_root: str | os.PathLike) -> dict[str, str]:
    """Point torch_tpu's cache tiers at hf_tpu's ``cache_root``: tier 3 at ``<cache_root>/torch_tpu``, tier 2 at the
    name :func:`tier2_name` gives. A variable already set (by the user) is kept. Returns the variables set here.

    torch_tpu reads them once, before its first compile: call this before the first op on a ``tpu`` tensor.
    """
    wanted = {TIER3_ENV: str(Path(cache_root).expanduser() / TIER3_SUBDIR), TIER2_ENV: tier2_name(cache_root)}
    written = {}
    for name, value in wanted.items():
        if os.environ.get(name, "").strip():
            continue
        os.environ[name] = value
        written[name] = value
    return written


def cache_tiers(environ: dict[str, str] | None = None) -> dict[str, dict[str, str | None]]:
    """Where torch_tpu's tier-2 and tier-3 caches live, read from the environment (for ``hf-tpu env``)."""
    env = os.environ if environ is None else environ
    name = env.get(TIER2_ENV, "").strip() or None
    if name is None:
        world = env.get("WORLD_SIZE", "1").strip() or "1"
        where = f"{TIER2_ROOT}/default" if world != "1" else "off (unset at world size 1)"
    elif name == TIER2_DISABLED:
        where = "off (disabled)"
    elif "/" in name:
        where = f"{TIER2_ROOT}/{name.strip('/')} (a name is expected, not a path)"
    else:
        where = f"{TIER2_ROOT}/{name} (per host, shared memory)"
    root = env.get(TIER3_ENV, "").strip() or None
    return {
        "tier2": {"variable": TIER2_ENV, "value": name, "where": where},
        "tier3": {"variable": TIER3_ENV, "value": root, "where": f"{root} (persistent)" if root else "off (unset)"},
    }


@dataclass(frozen=True)
class CacheStats:
    """torch_tpu's compilation-cache counters, process-wide: lookups (``requests``) and ``hits`` of its in-memory
    tier; a miss is a compile (or a load from tier 2/3). Subtract two snapshots for what happened in between."""

    requests: int
    hits: int

    @property
    def misses(self) -> int:
        return self.requests - self.hits

    def __sub__(self, other: CacheStats) -> CacheStats:
        return CacheStats(self.requests - other.requests, self.hits - other.hits)


def cache_stats() -> CacheStats | None:
    """``torch.tpu._get_cache_stats()`` as :class:`CacheStats` (``num_cache_reqs``, ``num_cache_hits``), or None
    when no ``tpu`` device module is loaded. The simulator's ``torch.tpu`` answers it from its own counters."""
    torch = sys.modules.get("torch")
    tpu = getattr(torch, "tpu", None) if torch is not None else None
    get = getattr(tpu, "_get_cache_stats", None)
    if get is None:
        return None
    stats = get()
    return CacheStats(int(stats.num_cache_reqs), int(stats.num_cache_hits))


# ---------------------------------------------------------------------------------------------------------------
# Lowering without a chip (used by hf_tpu.tpu_compile, in a child process of its own)
#
# With the wheel autoloaded on a host without chips, torch_tpu's device init runs (TPU_SKIP_MDS_QUERY=1 keeps libtpu
# from waiting on cloud metadata) and ``torch.compile(backend="tpu")`` runs Dynamo, AOTAutograd and the wheel's own
# front end (split/static compilers, ``export.fx_to_mlir``, ``tpu_torch_compile.build_mlir``) unchanged. Four things
# need a PjRt client, and only those are stood in for:
#   - the device's default generators (``torch.tpu.default_generators``, read by ``fx_to_mlir``) and the export-mode
#     generator plumbing around them (``make_export_mode_device_generator`` & co): a graph that draws random numbers
#     from the device generator (dropout, ``rand_like``) therefore does not lower here (torch_tpu would lower it);
#   - ``traverse_and_compile``'s XLA compile: the module is built with ``build_mlir`` and recorded as StableHLO text
#     with its arguments, outputs and donated inputs, instead of being compiled (libtpu compiles the text for a
#     described TPU in another process: hf_tpu.tpu_compile);
#   - ``execute``: a recorded program is never run; its outputs are deferred ``tpu`` tensors of the lowered shapes;
#   - a dynamic-shape graph's scalar inputs (``DynamicTpuCompiledExecutable._get_model_inputs`` copies each dynamic
#     int, a host-length decode's cache length, to the chip as an int32 tensor): they become deferred int32 tensors,
#     and the executable then lowers its graph for the bucket of torch_tpu's that holds the value, as on a chip;
#   - eager ops on ``tpu`` tensors outside a graph (a cache's allocation, a host->device copy, ``zero_``): torch_tpu
#     would run them on the chip; here a dispatch mode computes their shapes on the meta device and answers deferred
#     tensors (no memory), counting host<->device copies and host reads (``.item()`` answers 0).
# Device init renames PrivateUse1 and patches torch.compile and matmul precision for the whole process: call
# :func:`start_lowering` only in a process made for it.
# ---------------------------------------------------------------------------------------------------------------

#: The private torch_tpu names the lowering stand-in replaces or calls (checked by tests/contract against the wheel).
LOWERING_NAMES = {
    "torch_tpu._loader": ("_init_device",),
    "torch_tpu._internal.compile.tpu_torch_compile": (
        "build_mlir", "serialize_mlir_text", "serialize_mlir_portable_artifact", "traverse_and_compile", "execute", "make_export_mode_device_generator",
        "get_device_state_tensor", "set_export_mode_default_device_generator",
        "clear_export_mode_default_device_generators",
    ),
    "torch_tpu._internal.execution_mode": ("eager_mode", "EagerMode"),
    "torch_tpu._internal.compile.dynamic.dynamic_executable": ("DynamicTpuCompiledExecutable",),
}  # fmt: skip
#: What of ``DynamicTpuCompiledExecutable`` the stand-in reads (its instances' attributes and its method).
DYNAMIC_NAMES = ("_get_model_inputs", "_dynamic_scalar_map", "_default_scalar_tensor_cache", "_get_backend_device")


@dataclass
class LoweredProgram:
    """One graph as torch_tpu lowered it: StableHLO text, the module's arguments and results as lowered (shape,
    dtype name; their order is the module's, not Dynamo's) and the argument indices torch_tpu donated."""

    text: str
    arguments: list[tuple[tuple[int, ...], str]]
    outputs: list[tuple[tuple[int, ...], str]]
    donated: list[int]
    seconds: float = 0.0
    artifact: bytes | None = None  # torch_tpu's versioned portable artifact of the module (what a PjRt plugin takes)

    def to_dict(self) -> dict:
        return {
            "text": self.text, "arguments": [[list(s), d] for s, d in self.arguments],
            "outputs": [[list(s), d] for s, d in self.outputs], "donated": self.donated, "seconds": self.seconds,
            "artifact": base64.b64encode(self.artifact).decode() if self.artifact else None,
        }  # fmt: skip


@dataclass
class LoweringSession:
    """What a lowering process recorded: the programs in the order lowered, and the eager traffic the stand-in met
    outside graphs (ops, host->device and device->host copies, host reads of a device value)."""

    programs: list[LoweredProgram]
    counts: dict[str, int]
    mode: object  # the dispatch mode answering eager tpu ops; a context manager
    mark: object  # mark(): start the clock of the next program's lowering time now


class LoweringUnavailableError(UserError, RuntimeError):
    """torch-tpu (with libtpu) is not installed, or not the version the lowering stand-in was written for."""


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def start_lowering(announce=None) -> LoweringSession:
    """Initialise torch_tpu's device on a host without chips and stand in for what needs one (see above).

    ``announce(message)``, when given, is told of each program lowered (a progress line).

    Returns the session that records every program ``torch.compile(backend="tpu")`` lowers from then on; run eager
    ``tpu`` code inside ``with session.mode:``. Call once, in a process of its own.

    Raises:
        LoweringUnavailableError: torch-tpu is not installed, or its version is not the one this was written for.
    """
    version = installed_version()
    if version is None:
        raise LoweringUnavailableError(
            "compiling for a TPU needs torch-tpu and libtpu: pip install 'hf-tpu[tpu]' (torch==2.13.0 first)"
        )
    if version != WRITTEN_FOR:
        raise LoweringUnavailableError(
            f"the lowering stand-in was written for torch-tpu {WRITTEN_FOR} (it replaces private functions of "
            f"torch_tpu._internal.compile); torch-tpu {version} is installed: pip install torch-tpu=={WRITTEN_FOR}"
        )
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    import time

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_tpu import _patch
    from torch.utils._pytree import tree_flatten, tree_map

    loader = importlib.import_module("torch_tpu._loader")
    loader._init_device("tpu")
    ttc = importlib.import_module("torch_tpu._internal.compile.tpu_torch_compile")
    em = importlib.import_module("torch_tpu._internal.execution_mode")
    # The AOTAutograd cache would try to serialize the stand-in executable; backward runs on this thread, where the
    # stand-in's dispatch mode is (autograd's device threads would not see it).
    _patch.assign(
        torch._functorch.config, "enable_autograd_cache", False, feature="tpu_compile",
        reason="the lowering process's AOTAutograd cache cannot serialize the stand-in executable; for its life",
    )  # fmt: skip
    torch.autograd.set_multithreading_enabled(False)

    programs: list[LoweredProgram] = []
    counts = {"eager_ops": 0, "host_to_device": 0, "device_to_host": 0, "host_reads": 0}
    build_mlir, serialize = ttc.build_mlir, ttc.serialize_mlir_text
    portable = ttc.serialize_mlir_portable_artifact

    class _Generator:  # what fx_to_mlir reads of the default generator: an object with a device
        device = torch.device("tpu", 0)

    generator = _Generator()
    state: dict = {}

    def state_tensor(_gen):
        if "t" not in state:
            state["t"] = torch.empty(2, dtype=torch.int64, device="tpu")
        return state["t"]

    type(torch.tpu).default_generators = property(lambda self: (generator,))
    ttc.make_export_mode_device_generator = lambda gen: gen
    ttc.get_device_state_tensor = state_tensor
    ttc.set_export_mode_default_device_generator = lambda gen: None
    ttc.clear_export_mode_default_device_generators = lambda: None

    class _Recorded:
        def __init__(self, program: LoweredProgram):
            self.program = program

    class _Result:
        def __init__(self, module, executable):
            self.module, self.executable = module, executable

    clock = {"t": time.perf_counter()}

    def traverse_and_compile(result_tensors, argument_tensors, build_mlir_module=True, use_stablehlo_bounds=False,
                             argument_layouts=(), donated_inputs=(), module_name=None):  # fmt: skip
        module = build_mlir(
            result_tensors=result_tensors, argument_tensors=argument_tensors, use_stablehlo_bounds=use_stablehlo_bounds
        )
        program = LoweredProgram(
            text=serialize(module),
            artifact=portable(module),
            arguments=[(tuple(t.shape), _dtype_name(t.dtype)) for t in argument_tensors],
            outputs=[(tuple(t.shape), _dtype_name(t.dtype)) for t in result_tensors],
            donated=[int(i) for i in donated_inputs],
            seconds=time.perf_counter() - clock["t"],
        )
        programs.append(program)
        clock["t"] = time.perf_counter()
        if announce is not None:
            announce(f"lowered program {len(programs)} ({program.seconds:.1f}s, {len(program.text) // 1024} KiB)")
        return _Result(module, _Recorded(program))

    def execute(executable, args, output_shapes=(), reconstruct=None):
        outs = [
            torch.empty(shape, dtype=getattr(torch, dtype), device="tpu") for shape, dtype in executable.program.outputs
        ]
        return reconstruct(args, outs) if reconstruct is not None else outs

    ttc.traverse_and_compile = traverse_and_compile
    ttc.execute = execute

    dynamic = importlib.import_module("torch_tpu._internal.compile.dynamic.dynamic_executable")
    model_inputs = dynamic.DynamicTpuCompiledExecutable._get_model_inputs

    def deferred_scalars(self, args, pad_outputs):
        # each dynamic int as the deferred int32 tensor torch_tpu would copy it into (it caches them by value)
        for arg_idx, _ in self._dynamic_scalar_map:
            val = args[arg_idx]
            if val not in self._default_scalar_tensor_cache:
                self._default_scalar_tensor_cache[val] = torch.empty(
                    (), dtype=torch.int32, device=self._get_backend_device()
                )
        return model_inputs(self, args, pad_outputs)

    dynamic.DynamicTpuCompiledExecutable._get_model_inputs = deferred_scalars

    def lowering() -> bool:
        return em.eager_mode == em.EagerMode._INTERNAL_COMPILE_FX_GRAPH

    def on_tpu(x) -> bool:
        if isinstance(x, torch.Tensor):
            return x.device.type == "tpu"
        if isinstance(x, torch.device):
            return x.type == "tpu"
        return isinstance(x, str) and x.split(":")[0] == "tpu"

    def to_meta(x):
        if isinstance(x, torch.Tensor) and x.device.type == "tpu":
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return torch.device("meta") if on_tpu(x) and not isinstance(x, torch.Tensor) else x

    class DeferredEager(TorchDispatchMode):
        """Eager ops on tpu tensors answered with deferred tensors of the right shape (see the section comment)."""

        @classmethod
        def ignore_compile_internals(cls) -> bool:  # Dynamo compiles under this mode, ignoring it
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            flat, _ = tree_flatten((args, kwargs))
            if lowering() or not any(on_tpu(a) for a in flat):
                return func(*args, **kwargs)
            if any(isinstance(a, torch.Tensor) and type(a) not in (torch.Tensor, torch.nn.Parameter) for a in flat):
                return NotImplemented  # a tensor subclass (torchao's) unwraps itself first; its parts come back here
            counts["eager_ops"] += 1
            tensors = [a for a in flat if isinstance(a, torch.Tensor)]
            if func is torch.ops.aten._local_scalar_dense.default:
                counts["host_reads"] += 1
                dtype = args[0].dtype
                return 0.0 if dtype.is_floating_point else (False if dtype == torch.bool else 0)
            if func is torch.ops.aten.copy_.default:
                dst, src = args[0], args[1]
                if dst.device.type == "tpu" and src.device.type != "tpu":
                    counts["host_to_device"] += 1
                elif dst.device.type != "tpu":
                    counts["device_to_host"] += 1
                    return dst
                return dst
            to_host = func is torch.ops.aten._to_copy.default and not on_tpu(kwargs.get("device", "tpu"))
            if to_host:  # a device value read on the host: its shape, zeros for its data
                counts["device_to_host"] += 1
                return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
            if func is torch.ops.aten._to_copy.default and not on_tpu(args[0]):
                counts["host_to_device"] += 1
            meta_args, meta_kwargs = tree_map(to_meta, (args, kwargs))
            try:
                result = func(*meta_args, **meta_kwargs)
            except NotImplementedError as exc:
                raise UnsupportedError(
                    f"{func} on a tpu tensor outside a graph has no meta kernel, so the lowering stand-in cannot "
                    "answer it without a chip"
                ) from exc
            if func._schema.is_mutable and tensors:
                out = kwargs.get("out")
                return out if out is not None else args[0]

            def back(m):
                if isinstance(m, torch.Tensor) and m.device.type == "meta":
                    if to_host:
                        return torch.zeros(m.shape, dtype=m.dtype)
                    return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device="tpu")
                return m

            return tree_map(back, result)

    def mark() -> None:
        clock["t"] = time.perf_counter()

    return LoweringSession(programs=programs, counts=counts, mode=DeferredEager(), mark=mark)
