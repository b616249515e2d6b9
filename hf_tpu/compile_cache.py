"""A persistent compile cache: compile each graph once, ever, and reuse it in every later process.

On a TPU the expensive step is compiling; every new process pays again for each graph it needs. This cache keeps
what compiling produced on disk, under a directory named by ``cache_dir=`` or the ``HF_TPU_COMPILE_CACHE``
environment variable, so that a second process with the same model warms up and generates without tracing or
compiling a graph it has seen before.

What it stores, per *namespace* (one model, config, dtype, ladder, backend and library versions):

* ``key.json``: the namespace's key in clear (the SHA-256 of it names the directory);
* ``graphs/<sha256>.bin``: one graph each, saved with torch's ahead-of-time compile
  (``torch.compile(...).aot_compile``, ``AOTCompiledFunction.save_compiled_function``, torch 2.13): the captured bytecode, its guards on tensor
  shapes/dtypes/devices and global state, and the backend's compiled artifact (AOTAutograd's bundled entry: on the
  simulated device the functional FX graph; on a chip, torch_tpu's serialized executable);
* ``manifest.json``: the graphs the model needed so far, so that a new process's warm-up loads exactly that set.

On a chip, torch_tpu's own compilation cache is pointed here too (:func:`hf_tpu._torch_tpu.point_compile_cache`,
when the cache is created, unless the user set the variables): its persistent tier 3
(``TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT``, a path) at ``<cache_dir>/torch_tpu``, so the XLA programs behind the
graphs and the eager ops are kept next to them, and its per-host tier 2 (``TORCH_TPU_TIER2_COMPILATION_CACHE``, a
*name*: ``/dev/shm/torch_tpu_cache/<name>``, gone after a VM restart) at a name derived from the directory.
torch_tpu reads both once, before its first compile; a cache created after that is reported (tier 3 then needs
``HF_TPU_COMPILE_CACHE`` set before ``import hf_tpu``, or the variables set by hand).

A graph's key never lets a stale entry in: the namespace covers the hf_tpu, torch, torch-tpu, libtpu, transformers and
Python versions, the runtime mode, the model class, its config, dtype and attention implementation, a tensor-parallel
model's layout (TP size, rank, plan, KV-heads strategy, shard shapes), the ladder, the cache sizing, the backend,
the source of the graph functions and the ``HF_TPU_*`` variables that change what a graph computes (those
``hf_tpu._env`` marks ``graph=True``, such as ``HF_TPU_KV_WRITE``, where not at their default: docs/environment.md);
the graph file repeats the key and the graph's own id (its shape key and baked-in constants) and is checked on load;
the saved guards are checked on each call. Weights are graph inputs, never constants, so two checkpoints of one
architecture share entries. A corrupt entry, an entry from another version, a failed guard or an unwritable
directory is reported (:class:`CompileCacheWarning`, and ``CompileCache.problems``) and bypassed: the graph is
compiled as usual.

Example:
    >>> import hf_tpu                                                                          # doctest: +SKIP
    >>> hf_tpu.warmup(model, max_prompt_len=512, cache_dir="~/.cache/hf_tpu/compile")          # doctest: +SKIP
    >>> # a later process: same call, loads every graph (report.new_compiles == 0)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hf_tpu import _env, _torch_tpu
from hf_tpu.errors import HfTpuError, HfTpuValueError, InvalidTypeError

logger = logging.getLogger("hf_tpu.compile_cache")

__all__ = [
    "ENV",
    "TORCH_TPU_TIER2_ENV",
    "TORCH_TPU_TIER3_ENV",
    "CompileCache",
    "CompileCacheWarning",
    "Namespace",
    "model_identity",
]

ENV = _env.COMPILE_CACHE.name
# torch_tpu's C++ runtime reads these (see hf_tpu._torch_tpu: tier 2 is a name, tier 3 a path).
TORCH_TPU_TIER2_ENV = _torch_tpu.TIER2_ENV
TORCH_TPU_TIER3_ENV = _torch_tpu.TIER3_ENV
FORMAT = 1
_MAGIC = b"HF_TPU_GRAPH\n"
_GUARD_FAILED = "GuardManager check failed"


class CompileCacheWarning(UserWarning):
    """The compile cache could not serve or store a graph; it was compiled as usual."""


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` + ``.lock`` for the block (released by the OS if the process dies), so that
    processes writing the same manifest at once (ranks, parallel warm-ups) merge their entries instead of one
    overwriting the other's, and so that actors starting at once on one cache warm up one after the other (the
    later ones load what the first compiled: :mod:`hf_tpu.ray.batch`). Without ``fcntl`` (Windows) the block runs
    unlocked.

    Args:
        path: the file the lock is named after (``path`` + ``.lock`` is created beside it).

    Yields:
        Nothing: the lock is held while the block runs.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Any]:
    """The library versions every namespace key holds."""
    import torch

    from hf_tpu import runtime
    from hf_tpu._version import __version__

    return {
        "format": FORMAT,
        "hf_tpu": __version__,
        "torch": torch.__version__,
        "torch_tpu": _version("torch-tpu") or _version("torch_tpu"),
        "libtpu": _version("libtpu"),
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "runtime": runtime.detect().mode,
    }


def model_identity(model) -> dict[str, Any]:
    """What a compiled graph of ``model`` depends on besides its shapes and weights: transformers' version, the
    model class, a hash of its config (paths and versions left out), attention implementation, dtype and device
    type, and for a tensor-parallel model its layout (:func:`_parallel_layout`). Generation's and serving's
    compile-cache namespaces start from it.

    Args:
        model: a transformers model (its ``config``, ``dtype`` and ``device`` are read; for the layout, its
            parallel attributes and parameters).

    Returns:
        A JSON-able dict: ``transformers``, ``model_class``, ``config`` (a sha256), ``attn_implementation``,
        ``dtype`` and ``device``; for a float32 model also ``float32_matmul_precision``; for a tensor-parallel model (or one with DTensor parameters) also
        ``parallel``, the dict of :func:`_parallel_layout`. A model without one has no ``parallel`` key, so its
        identity is the one it had before the layout joined the key (existing caches stay valid).
    """
    import torch
    import transformers

    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "name_or_path"):
        config.pop(volatile, None)
    cls = type(model)
    identity = {
        "transformers": transformers.__version__,
        "model_class": f"{cls.__module__}.{cls.__qualname__}",
        "config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "dtype": str(model.dtype),
        "device": model.device.type,
    }
    if model.dtype == torch.float32:
        # torch_tpu compiles a float32 matmul at the precision in force and a compiled program keeps it (on a v5e a
        # graph first compiled at 'medium' stayed at 'medium' after set_float32_matmul_precision('highest'), run 18):
        # a graph stored at one precision must not be loaded at another
        from hf_tpu.numerics import matmul_precision

        identity["float32_matmul_precision"] = matmul_precision()
    layout = _parallel_layout(model)
    if layout is not None:
        identity["parallel"] = layout
    return identity


def _json_sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _parallel_layout(model) -> dict[str, Any] | None:
    """How ``model``'s weights are laid out over a tensor-parallel group, as far as this process's graphs depend
    on it; None for a model that is not split (``_tp_size`` unset or 1, and no DTensor parameter).

    A graph traced on one rank of one layout computes with that rank's shard shapes, plan and rank-dependent
    constants: the config is the same for every layout and rank, so without this part a cache shared by the
    ranks of a launch, or by launches with another KV-heads strategy, served one layout's graphs to another
    (wrong tokens where the shard shapes happened to pass the graph's guards).

    Args:
        model: a transformers model, loaded with ``DistributedConfig(tp_size=...)`` (``_tp_size``, ``_tp_plan``,
            ``_mesh_manager``) or holding DTensor parameters otherwise.

    Returns:
        None, or a JSON-able dict: ``tp_size``; ``rank`` (this process's rank in the TP group); ``meshes`` (per
        device mesh of the DTensor parameters: dimension names, global ranks and this process's coordinate, since
        a graph names the process group its collectives run over, ``all_reduce(x, 'sum', '0')``); ``plan`` (a
        sha256 of the fixed plan, ``_tp_plan``); ``kv_heads`` (the KV-heads strategy hf_tpu's plan fix loaded it
        with, None when it did not run) and ``local_shapes`` (a sha256 of each parameter's name, local shape and
        placements).
    """
    tp_size = getattr(model, "_tp_size", None) or 1
    shapes, meshes = [], {}
    for name, param in model.named_parameters():
        local = getattr(param, "_local_tensor", None)  # a DTensor's shard on this rank (``to_local()``)
        if local is None:
            shapes.append([name, list(param.shape)])
            continue
        shapes.append([name, list(local.shape), [str(p) for p in param.placements]])
        mesh = param.device_mesh
        coordinate = mesh.get_coordinate()  # None where this rank is not in the mesh
        described = {
            "dims": list(mesh.mesh_dim_names or ()),
            "ranks": mesh.mesh.tolist(),
            "coordinate": None if coordinate is None else list(coordinate),
        }
        meshes[json.dumps(described, default=str)] = described
    if tp_size <= 1 and not meshes:
        return None
    return {
        "tp_size": tp_size,
        "rank": _tp_rank(model),
        "meshes": [meshes[k] for k in sorted(meshes)],
        "plan": _json_sha(getattr(model, "_tp_plan", None)),
        # set on the model by hf_tpu.distributed.tp_plan when it fixed the plan: the process-wide setting may have
        # changed since the model was loaded
        "kv_heads": getattr(model, "_hf_tpu_kv_heads_strategy", None),
        "local_shapes": _json_sha(shapes),
    }


def _tp_rank(model) -> int | None:
    """This process's rank in ``model``'s TP group: its ``tp`` mesh's local rank, else the global rank."""
    manager = getattr(model, "_mesh_manager", None)
    if manager is not None:
        try:
            return manager.get_mesh("tp").get_local_rank()
        except Exception:  # noqa: BLE001 - a manager without a tp mesh: fall back to the global rank
            logger.debug("no tp mesh on %r", manager, exc_info=True)
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


class CompileCache:
    """A compile-cache directory. ``problems`` lists what was reported and bypassed in this process.

    Args:
        root: the directory (``~`` expanded; created on first use). On a TPU chip, torch_tpu's own tier-2 and
            tier-3 caches are pointed here too, unless the user set them.

    Example:
        >>> cache = CompileCache("/tmp/hf-tpu-compile-cache")                 # doctest: +SKIP
        >>> cache.clear()                                                       # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser()
        self.problems: list[str] = []
        self._reported: set[str] = set()
        self._spaces: dict[str, Namespace] = {}
        self._point_torch_tpu_here()

    def __repr__(self) -> str:
        return f"CompileCache({str(self.root)!r})"

    @classmethod
    def from_env(cls) -> CompileCache | None:
        """The cache ``HF_TPU_COMPILE_CACHE`` names, or None when it is unset or empty.

        Returns:
            A :class:`CompileCache` over that directory, or None.
        """
        value = _env.COMPILE_CACHE.get()
        return cls(value) if value else None

    @classmethod
    def coerce(cls, value: Any) -> CompileCache | None:
        """A cache from a path or a cache; None or False mean no cache.

        Args:
            value: a directory path, a :class:`CompileCache` (returned as it is), None or False.

        Returns:
            The :class:`CompileCache`, or None for None / False.

        Raises:
            TypeError (InvalidTypeError): ``value`` is none of the above.
        """
        if value is None or value is False:
            return None
        if isinstance(value, CompileCache):
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls(value)
        raise InvalidTypeError(f"cache_dir must be a directory path, a CompileCache, None or False; got {value!r}")

    @property
    def base(self) -> Path:
        return self.root / f"hf_tpu-v{FORMAT}"

    def report(self, message: str) -> None:
        """Warn once per message (the graph is compiled as usual) and remember it in :attr:`problems`.

        Args:
            message: what went wrong and what happens instead; a message already reported is not warned again.
        """
        if message in self._reported:
            return
        self._reported.add(message)
        self.problems.append(message)
        logger.warning("hf_tpu compile cache: %s", message)
        warnings.warn(f"hf_tpu compile cache: {message}", CompileCacheWarning, stacklevel=3)

    def namespace(self, kind: str, parts: dict[str, Any]) -> Namespace | None:
        """The namespace for ``parts`` (versions added), created on disk; None when the directory is unusable.

        Args:
            kind: what is cached (``"generate"``, ``"diffusers"``, ...); it starts the namespace's folder name.
            parts: the rest of the key (model config, shapes, dtypes, ...), JSON-serializable; with the versions of
                :func:`versions` and the graph-changing ``HF_TPU_*`` variables set to something other than their
                default (:func:`hf_tpu._env.graph_key`, under ``"environment"``) it is hashed into the folder name
                and stored in ``key.json``.

        Returns:
            The :class:`Namespace` (the same object for the same key within a process), or None when the directory
            cannot be created or written (reported through :meth:`report`).
        """
        key = {**versions(), "kind": kind, **parts}
        switches = _env.graph_key()  # the HF_TPU_* variables that change what a graph computes, where not default
        if switches:
            key["environment"] = switches
        text = json.dumps(key, sort_keys=True, default=str)
        name = f"{kind}-{_sha(text)[:24]}"
        space = self._spaces.get(name)
        if space is not None:
            return space
        path = self.base / name
        try:
            path.mkdir(parents=True, exist_ok=True)
            key_file = path / "key.json"
            if key_file.exists():
                try:
                    stored = json.loads(key_file.read_text())
                except (OSError, ValueError):
                    stored = None
                if stored != json.loads(text):
                    self.report(f"{key_file} does not match its directory's key (corrupt or edited); rewriting it")
                    _atomic_write(key_file, text.encode())
            else:
                _atomic_write(key_file, text.encode())
        except OSError as exc:
            self.report(f"cannot use {self.root} ({exc}); compiling without a cache")
            return None
        space = Namespace(self, path, key)
        self._spaces[name] = space
        return space

    def _point_torch_tpu_here(self) -> None:
        """On a chip, point torch_tpu's tier-2 name and tier-3 root here (kept when the user set them)."""
        from hf_tpu import runtime

        if runtime.detect().mode != "real":
            return
        before = _torch_tpu.cache_stats()
        written = _torch_tpu.point_compile_cache(self.root)
        if written and before is not None and before.requests:
            self.report(
                f"torch_tpu already compiled ({before.requests} cache requests) before this compile cache was "
                f"created, so it has read its cache settings: {', '.join(written)} take effect in the next "
                f"process only. Set {ENV}={self.root} before `import hf_tpu`, or create the cache before the first "
                "op on the TPU."
            )

    def clear(self) -> None:
        """Delete every entry hf_tpu stored here: its graphs, torch_tpu's tier-3 cache under ``torch_tpu/``, and
        torch_tpu's tier-2 cache of the name hf_tpu gives this directory (``/dev/shm/torch_tpu_cache/<name>``)."""
        import shutil

        tier2 = Path(_torch_tpu.TIER2_ROOT) / _torch_tpu.tier2_name(self.root)
        for sub in (self.base, self.root / _torch_tpu.TIER3_SUBDIR, tier2):
            shutil.rmtree(sub, ignore_errors=True)
        self._spaces.clear()


class Namespace:
    """The entries of one model (or pipeline component) under one key: graphs and the manifest of needed graphs.

    Made by :meth:`CompileCache.namespace`, not by hand.

    Args:
        cache: the :class:`CompileCache` it belongs to (problems are reported there).
        path: its folder.
        key: the key it was made for, stored in each graph file's header and checked on load.
    """

    def __init__(self, cache: CompileCache, path: Path, key: dict[str, Any]) -> None:
        self.cache, self.path, self.key = cache, path, key
        self._key_text = json.dumps(key, sort_keys=True, default=str)

    def graph_path(self, graph_id: str) -> Path:
        """Where one graph is stored.

        Args:
            graph_id: the caller's name for the graph (shapes, phase, ...); it is hashed into the file name.

        Returns:
            The graph file's path under this namespace's ``graphs/`` folder (it may not exist).
        """
        return self.path / "graphs" / f"{_sha(graph_id)[:32]}.bin"

    # -- graphs ---------------------------------------------------------------------------------------------------

    def load(self, graph_id: str, describe: str = "graph", roots: tuple = ()) -> Callable | None:
        """The stored graph, deserialized; None when absent, or (reported) corrupt or from another version.

        Args:
            graph_id: the graph's name, as given to :meth:`save`.
            describe: how messages name the graph (``"decode graph"``, ...).
            roots: the modules the graph runs (see :mod:`hf_tpu._capture_registry`).

        Returns:
            The compiled function, or None (absent, corrupt, stored for another key, or not loadable: each but the
            first reported through :meth:`CompileCache.report`).
        """
        path = self.graph_path(graph_id)
        if not path.exists():
            return None
        try:
            data = path.read_bytes()
            if not data.startswith(_MAGIC):
                raise HfTpuValueError("not an hf_tpu graph file")
            header, _, payload = data[len(_MAGIC) :].partition(b"\n")
            meta = json.loads(header)
        except (OSError, HfTpuValueError, ValueError) as exc:  # (HfTpuValueError: not ours; ValueError: bad JSON)
            self.cache.report(f"{path} is corrupt ({exc}); compiling the {describe} again")
            return None
        if meta.get("key") != self._key_text or meta.get("graph") != graph_id:
            self.cache.report(
                f"{path} was stored for another model, version or graph; compiling the {describe} again"
            )
            return None
        import io

        import torch

        from hf_tpu._capture_registry import stable_positions

        try:
            with stable_positions(roots):
                return torch.compiler.load_compiled_function(io.BytesIO(payload))
        except Exception as exc:  # noqa: BLE001 - any failure to deserialize means: compile instead
            logger.debug("loading %s failed", path, exc_info=True)
            self.cache.report(
                f"{path} could not be loaded ({type(exc).__name__}: {exc}, raised {_where(exc)}); compiling the "
                f"{describe}"
            )
            return None

    def save(self, graph_id: str, compiled: Any, describe: str = "graph") -> None:
        """Store an ``AOTCompiledFunction``; a failure is reported, never raised.

        Args:
            graph_id: the graph's name, as :meth:`load` will ask for it.
            compiled: the ``AOTCompiledFunction`` of ``torch.compile(...).aot_compile``.
            describe: how messages name the graph.
        """
        path = self.graph_path(graph_id)
        try:
            payload = type(compiled).serialize(compiled).serialized_data
            header = json.dumps({"key": self._key_text, "graph": graph_id}).encode()
            _atomic_write(path, _MAGIC + header + b"\n" + payload)
        except Exception as exc:  # noqa: BLE001 - an unsavable graph still runs; it is compiled again next time
            self.cache.report(f"cannot store the {describe} in {self.path} ({type(exc).__name__}: {exc})")

    def load_or_compile(
        self, graph_id: str, fn: Callable, backend: Any, args: tuple, describe: str = "graph"
    ) -> Callable | None:
        """The graph of ``fn`` for ``args``: loaded (nothing traced or compiled) or compiled ahead of time with
        ``backend`` and stored. None when neither works (reported; the caller compiles as usual).

        Args:
            graph_id: the graph's name in this namespace.
            fn: the function to compile (``fullgraph=True, dynamic=False``).
            backend: the ``torch.compile`` backend.
            args: the example arguments the graph is compiled for (its modules are the graph's roots).
            describe: how messages name the graph.

        Returns:
            A callable running the graph (on inputs its guards reject it reports and raises
            :class:`StaleGraphError`, so that the caller compiles as usual), or None.
        """
        roots = tuple(args)  # the modules among them: see hf_tpu._capture_registry
        loaded = self.load(graph_id, describe, roots)
        if loaded is not None:
            return _Guarded(self.cache, loaded, describe, from_disk=True)
        import torch

        from hf_tpu._capture_registry import stable_positions

        try:
            with stable_positions(roots):
                compiled = torch.compile(
                    fn, backend=backend, fullgraph=True, dynamic=False, options={"guard_filter_fn": _portable_guards}
                ).aot_compile((args, {}))
        except Exception as exc:  # noqa: BLE001 - e.g. a backend whose output cannot be serialized
            self.cache.report(
                f"cannot compile the {describe} ahead of time ({type(exc).__name__}: {exc}); compiling it as usual"
            )
            return None
        self.save(graph_id, compiled, describe)
        return _Guarded(self.cache, compiled, describe)

    # -- manifest -------------------------------------------------------------------------------------------------

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    def manifest(self) -> list:
        """The entries recorded so far (each a JSON value the caller chose); [] when none or unreadable.

        Returns:
            The list of entries of ``manifest.json`` (an unreadable file is reported and reads as []).
        """
        try:
            data = json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            self.cache.report(f"{self.manifest_path} is unreadable ({exc}); ignoring it")
            return []
        entries = data.get("entries") if isinstance(data, dict) else None
        return entries if isinstance(entries, list) else []

    def record(self, entries: list) -> None:
        """Add entries to the manifest (kept in order, without duplicates; concurrent writers merge).

        Args:
            entries: JSON values to add; those already present are skipped. A write failure is reported.
        """
        if all(e in self.manifest() for e in entries):
            return
        try:
            with exclusive(self.manifest_path):
                current = self.manifest()  # read again under the lock: another process may have added entries
                merged = current + [e for e in entries if e not in current]
                if merged != current:
                    payload = json.dumps({"format": FORMAT, "entries": merged}, indent=1).encode()
                    _atomic_write(self.manifest_path, payload)
        except OSError as exc:
            self.cache.report(f"cannot write {self.manifest_path} ({exc})")


def _where(exc: BaseException) -> str:
    """Where ``exc`` was raised, as ``in FUNCTION (FILE:LINE)`` of the innermost frame in a file (not ``<string>``), so
    that a failure deep in torch's loader names the step that failed (``get_value (torch/_guards.py:...)``: a guard's
    source evaluated while the graph's guards were rebuilt; ``deserialize``: the payload itself). The full traceback
    is logged at debug level (logger ``hf_tpu.compile_cache``)."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    if not frames:
        return "while loading"
    f = frames[-1]
    parts = Path(f.filename).parts
    return f"in {f.name} ({'/'.join(parts[-3:])}:{f.lineno})"


# Graphs loaded from any compile cache in this process (warm-up reports the difference).
HITS = [0]


def _note_hit() -> None:
    from hf_tpu import runtime

    HITS[0] += 1
    if runtime.detect().mode == "simulated":
        from hf_tpu.sim import _backend

        _backend.note_cache_hit()


def _portable_guards(entries) -> list[bool]:
    """Keep the guards a saved graph can carry to another process: tensor shapes, dtypes, devices, sequence
    lengths, dict keys and global state. Identity and constant guards (``ID_MATCH``, ``CONSTANT_MATCH``, closures,
    classes, modules) cannot be serialized (torch 2.13 raises ``PackageError``); what they protect is in the
    namespace key (model class, config, versions) and the graph id (shape key, variant, baked-in constants)."""
    from torch._dynamo.guards import CheckFunctionManager

    dropped = {"ID_MATCH", "CLOSURE_MATCH", "CLASS_MATCH", "TYPE_MATCH", "FUNCTION_MATCH", "MODULE_MATCH", "NN_MODULE"}
    dropped |= {"CONSTANT_MATCH", "DICT_VERSION", "OBJECT_MUTATION"}
    dropped |= set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    # A guard reached through a function's closure cannot be rebuilt in another process either (transformers 5.25
    # with kernels 0.19: a sequence-length guard on the defaults of a kernelized function's closure, ``..._kernel_funcs
    # ['rotary_pos_emb']...__closure__[0].cell_contents.__defaults__``, fails in ``get_value`` on load).
    return [not (e.is_global or e.guard_type in dropped or "__closure__" in e.name) for e in entries]


class _Guarded:
    """A cached graph: checks its guards on each call; a failure (a stale entry slipped past the key) is reported
    and raised as :class:`StaleGraphError` so that the caller compiles the graph as usual. A graph loaded from disk
    counts as a cache hit when it first runs (a graph its guards reject served nothing)."""

    def __init__(self, cache: CompileCache, fn: Callable, describe: str, from_disk: bool = False) -> None:
        self.cache, self.fn, self.describe, self.pending_hit = cache, fn, describe, from_disk

    def __call__(self, *args: Any) -> Any:
        try:
            result = self.fn(*args)
        except RuntimeError as exc:
            if _GUARD_FAILED not in str(exc):
                raise
            self.cache.report(f"the cached {self.describe} does not fit these inputs ({exc}); compiling it")
            raise StaleGraphError(str(exc)) from exc
        if self.pending_hit:
            self.pending_hit = False
            _note_hit()
        return result


class StaleGraphError(HfTpuError, RuntimeError):
    """A cached graph's guards rejected the inputs (nothing ran); compile the graph instead."""
