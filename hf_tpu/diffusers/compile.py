"""Compile a diffusion pipeline's denoiser for the TPU and warm it up ahead of time, one resolution at a time.

On a TPU every new input shape is a new XLA program, so the denoiser (the SD3 transformer, a UNet) is compiled
whole (``fullgraph=True``) for fixed shapes (``dynamic=False``): one compile per resolution and batch size, after
which every step of every call at that size reuses it. :func:`warmup` pays those compiles up front for the sizes
a service will be asked for (its resolution buckets), with a progress bar, so that the first user does not wait.

The module is compiled in place (``nn.Module.compile``), so ``pipe.transformer`` stays the same object: its
``config``, ``pipe.to(...)``, ``save_pretrained`` and LoRA loading keep working, and :func:`uncompile_pipeline`
undoes it.

With a persistent compile cache (``cache_dir=`` on :func:`compile_pipeline` or :func:`warmup`, or the
``HF_TPU_COMPILE_CACHE`` environment variable; :mod:`hf_tpu.compile_cache`), each graph (one per call signature:
resolution, batch, guidance) is loaded from the cache when an earlier process stored it, and stored when compiled,
so a new process warms its resolution buckets without compiling. The namespace key holds the pipeline and
denoiser classes, the denoiser's config, dtype and device, the compile options and the library versions.

Example:
    >>> import torch, hf_tpu
    >>> from diffusers import StableDiffusion3Pipeline
    >>> from hf_tpu.diffusers import compile_pipeline, warmup
    >>> pipe = StableDiffusion3Pipeline.from_pretrained(path, dtype=torch.bfloat16).to("tpu")  # doctest: +SKIP
    >>> compile_pipeline(pipe)                                                                  # doctest: +SKIP
    >>> warmup(pipe, resolutions=[512, (768, 1024)])                                           # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hf_tpu.diffusers._call_checks import install_call_checks
from hf_tpu.diffusers._checks import check_resolution, denoisers
from hf_tpu.errors import HfTpuRuntimeError, InvalidArgumentError

__all__ = ["WarmupResult", "compile_pipeline", "compiled_modules", "uncompile_pipeline", "warmup"]

_UNSET: Any = object()

_MARK = "_hf_tpu_compile_options"


def _graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (all backends), to report what a warm-up cost."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _module_device(module: Any) -> Any:
    import torch

    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def compile_pipeline(
    pipe: Any,
    *,
    backend: str | Any = "tpu",
    fullgraph: bool = True,
    dynamic: bool = False,
    recompile_limit: int = 64,
    options: dict[str, Any] | None = None,
    cache_dir: Any = _UNSET,
    vae: bool = False,
    strict: bool = False,
) -> Any:
    """Compile every module the pipeline calls per step (:func:`denoisers`: the transformer or UNet, the second
    expert ``transformer_2`` of Wan 2.2, a prior, a decoder, a ControlNet), and with ``vae=True`` its VAE decoder,
    in place; returns ``pipe``. Works on a ``DiffusionPipeline`` and on a Modular Diffusers ``ModularPipeline``.

    ``backend="tpu", fullgraph=True, dynamic=False``: each module is one graph, and each resolution/batch size
    compiles exactly once. A denoiser with data-dependent code cannot be one graph: on its first call it is
    compiled again with graph breaks (``fullgraph=False``) and a warning names each break and its cost (the step
    waits for the host at every break); ``strict=True`` makes that an error instead. ``recompile_limit`` is how many
    shapes one module may be compiled for (torch's default of 8 would stop at the eighth resolution; with
    ``fullgraph=True`` going past the limit raises instead of falling back to eager). Calling it again with
    the same arguments does nothing. Each later call's size and generator are checked before the compiled
    graph sees them (:func:`check_resolution`, :func:`check_generator`). ``cache_dir``: the persistent compile
    cache (a directory, or None for none; default ``HF_TPU_COMPILE_CACHE``). ``vae=True`` also compiles
    ``pipe.vae.decoder`` (one more graph per resolution; the decoder runs once per call; not served from the
    persistent cache). Like ``hf_tpu.enable("diffusers")``, it has the tpu backend trace GroupNorm with a contiguous
    input (:mod:`hf_tpu._group_norm`; the VAE's mid-block does not lower on torch_tpu 0.2.0 otherwise), until
    ``hf_tpu.disable()``.

    Args:
        pipe: a ``DiffusionPipeline`` or ``ModularPipeline`` placed on the TPU.
        backend, fullgraph, dynamic, options: what ``torch.compile`` gets for each module (``options``: None
            passes none).
        recompile_limit: how many shapes one module may be compiled for.
        cache_dir: the persistent compile cache directory, None for none (default ``HF_TPU_COMPILE_CACHE``).
        vae: also compile the VAE decoder.
        strict: a graph break is an error instead of a warning.

    Returns:
        ``pipe``, its modules compiled in place.

    Raises:
        hf_tpu.runtime.TPUNotAvailableError: ``backend="tpu"`` without a TPU (or the simulator).
        ValueError (InvalidArgumentError): a later call's resolution or generator the compiled graphs cannot take
            (named, with the fix).

    Example:
        >>> pipe.to("tpu")                 # doctest: +SKIP
        >>> compile_pipeline(pipe)         # doctest: +SKIP
        >>> image = pipe("a cat", height=512, width=512).images[0]   # compiles once   # doctest: +SKIP
        >>> image = pipe("a dog", height=512, width=512).images[0]   # compiles nothing # doctest: +SKIP
    """
    import torch

    if backend == "tpu":
        from hf_tpu.runtime import require_tpu

        require_tpu("compile_pipeline(pipe, backend='tpu')")
    kwargs: dict[str, Any] = {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic}
    if options:
        kwargs["options"] = dict(options)
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        kwargs["recompile_limit"] = recompile_limit
    # The denoiser runs every step; the VAE decoder once per call, so compiling it is opt-in (one more graph per
    # resolution to warm up). Its mid-block attention leaves a channels-last residual that the next GroupNorm gets:
    # torch_tpu 0.2.0's lowering refuses that (and the simulator, as it does) unless the tpu backend traces GroupNorm
    # with a contiguous input, hf_tpu._group_norm's decomposition, added here as the diffusers integration adds it.
    targets = denoisers(pipe)
    decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
    if vae and decoder is not None:
        targets.append(("vae.decoder", decoder))
    if backend == "tpu":
        for name, module in targets:
            device = _module_device(module)
            if device.type != "tpu":
                raise InvalidArgumentError(
                    f"compile_pipeline(backend='tpu') needs {type(pipe).__name__}.{name} on the TPU, but it is on "
                    f"{device}: call pipe.to('tpu') first."
                )
    from hf_tpu import _group_norm
    from hf_tpu.diffusers.placement import FEATURE

    _group_norm.apply(FEATURE)  # (the tpu backend's table only: no effect on any other backend)
    from hf_tpu.compile_cache import CompileCache

    cache = CompileCache.from_env() if cache_dir is _UNSET else CompileCache.coerce(cache_dir)
    mark = {**kwargs, "strict": strict}
    for name, module in targets:
        if getattr(module, _MARK, None) != mark or module._compiled_call_impl is None:
            module.compile(**kwargs)
            if fullgraph:
                module._compiled_call_impl = _GraphBreaks(pipe, name, module, kwargs, strict)
            setattr(module, _MARK, mark)
        # The denoisers are keyed by their model config; the VAE decoder (a plain nn.Module) compiles per process.
        if cache is not None and name != "vae.decoder":
            _attach_cache(pipe, name, module, cache)
    # Check each call's size and generator before the compiled graph sees them (see _call_checks).
    install_call_checks(pipe)
    return pipe


def compiled_modules(pipe: Any) -> list[str]:
    """Names of the pipeline modules that :func:`compile_pipeline` compiled (and that are still compiled).

    Args:
        pipe: a pipeline.

    Returns:
        Dotted names under ``pipe.components`` (``"transformer"``, ``"vae.decoder"``, ...).
    """
    import torch

    names = []
    for name, component in pipe.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        for sub_name, sub in component.named_modules():
            if getattr(sub, _MARK, None) is not None and sub._compiled_call_impl is not None:
                names.append(f"{name}.{sub_name}" if sub_name else name)
    return names


def uncompile_pipeline(pipe: Any) -> Any:
    """Undo :func:`compile_pipeline`: the modules run eagerly again. Returns ``pipe``.

    Args:
        pipe: a pipeline :func:`compile_pipeline` compiled (one it did not is left as it is).

    Returns:
        ``pipe``, its modules back to eager.
    """
    import torch

    for component in pipe.components.values():
        if not isinstance(component, torch.nn.Module):
            continue
        for sub in component.modules():
            if getattr(sub, _MARK, None) is not None:
                sub._compiled_call_impl = None
                delattr(sub, _MARK)
    return pipe


@dataclass(frozen=True)
class WarmupResult:
    """One warmed-up resolution: its size, the wall time of the warm-up call, and the graphs it compiled.

    Attributes:
        height: the image height, in pixels.
        width: the image width, in pixels.
        seconds: wall time of the warm-up call.
        graphs: graphs compiled during it.
        from_cache: graphs loaded from the persistent compile cache instead of compiled.
    """

    height: int
    width: int
    seconds: float
    graphs: int
    from_cache: int = 0


def _sizes(resolutions: Iterable[int | Sequence[int]]) -> list[tuple[int, int]]:
    sizes = []
    for r in resolutions:
        if isinstance(r, int) and not isinstance(r, bool):
            sizes.append((r, r))
        elif isinstance(r, (tuple, list)) and len(r) == 2:
            sizes.append((r[0], r[1]))
        else:
            raise InvalidArgumentError(
                f"warmup: a resolution is an int (square) or a (height, width) pair, got {r!r}."
            )
    return list(dict.fromkeys(sizes))


def warmup(
    pipe: Any,
    resolutions: Iterable[int | Sequence[int]],
    *,
    prompt: str | None = "warm-up",
    num_inference_steps: int | None = None,
    progress: bool = True,
    cache_dir: Any = _UNSET,
    **call_kwargs: Any,
) -> list[WarmupResult]:
    """Run the pipeline once at each resolution so that every graph those sizes need is compiled before use.

    Pass the call arguments that change shapes as you will use them later (``guidance_scale`` decides whether
    the batch is doubled for classifier-free guidance, ``num_images_per_prompt``, ``max_sequence_length``, and
    ``num_inference_steps``: the denoiser's graph does not depend on it, but the scheduler's small eager ops
    do; ``None`` runs the pipeline's default).
    Every size is checked first (:func:`check_resolution`), so a bad one fails before anything compiles.
    ``cache_dir`` attaches a persistent compile cache to the modules :func:`compile_pipeline` compiled (see
    :mod:`hf_tpu.compile_cache`): graphs found there are loaded, not compiled (``WarmupResult.from_cache``).
    Returns one :class:`WarmupResult` per size.

    Args:
        pipe: the pipeline, on the TPU, usually compiled by :func:`compile_pipeline` first.
        resolutions: sizes to warm up: an int for a square image, or a ``(height, width)`` pair (repeats run once).
        prompt: the prompt of the warm-up calls (passed when the pipeline takes one); None passes none.
        num_inference_steps: steps per warm-up call; None (the default) runs the pipeline's default.
        progress: show a progress bar over the sizes.
        cache_dir: a persistent compile cache to attach to the compiled denoisers (a directory or a
            :class:`~hf_tpu.compile_cache.CompileCache`); not given or None: leave them as they are.
        **call_kwargs: further arguments of the pipeline call, as later calls will pass them (``guidance_scale``,
            ``num_images_per_prompt``, ...); ``output_type`` defaults to ``"np"``.

    Returns:
        One :class:`WarmupResult` per distinct size, in order.

    Raises:
        ValueError (InvalidArgumentError): no resolutions, a resolution that is neither an int nor a pair, a size the
            pipeline cannot make (:func:`check_resolution`), or ``cache_dir`` given while a denoiser is not compiled.

    Example:
        >>> compile_pipeline(pipe)                                        # doctest: +SKIP
        >>> for r in warmup(pipe, resolutions=[512, (512, 768)]):        # doctest: +SKIP
        ...     print(r.height, r.width, r.graphs, f"{r.seconds:.1f}s")
    """
    import torch
    from tqdm.auto import tqdm

    from hf_tpu import compile_cache

    sizes = _sizes(resolutions)
    if not sizes:
        raise InvalidArgumentError("warmup: no resolutions given; pass e.g. resolutions=[512, (768, 1024)].")
    if cache_dir is not _UNSET and cache_dir is not None:
        cache = compile_cache.CompileCache.coerce(cache_dir)
        for name, module in denoisers(pipe):
            if getattr(module, _MARK, None) is None or module._compiled_call_impl is None:
                raise InvalidArgumentError(
                    f"warmup(pipe, cache_dir=...) caches compiled graphs, but the denoiser {name} is not compiled: "
                    "call hf_tpu.diffusers.compile_pipeline(pipe) first (or pass cache_dir to it)."
                )
            _attach_cache(pipe, name, module, cache)
    for height, width in sizes:
        check_resolution(pipe, height, width)
    blocks = getattr(pipe, "blocks", None)  # a Modular Diffusers pipeline takes its blocks' inputs as keywords
    if blocks is not None and hasattr(blocks, "inputs"):
        params = {p.name for p in blocks.inputs if getattr(p, "name", None)}
    else:
        params = set(inspect.signature(pipe.__call__).parameters)
    if num_inference_steps is not None:
        call_kwargs["num_inference_steps"] = num_inference_steps
    if prompt is not None and "prompt" in params:
        call_kwargs.setdefault("prompt", prompt)
    if blocks is None or "output_type" in params:
        call_kwargs.setdefault("output_type", "np")
    saved_bar = dict(getattr(pipe, "_progress_bar_config", {}))
    pipe.set_progress_bar_config(disable=True)
    results = []
    try:
        bar = tqdm(sizes, desc="hf_tpu warm-up", unit="size", disable=not progress)
        for height, width in bar:
            bar.set_postfix_str(f"{height}x{width}")
            before, hits = _graphs_compiled(), compile_cache.HITS[0]
            start = time.perf_counter()
            # No inference_mode here: the pipeline runs under no_grad, and a graph compiled for inference
            # tensors would not be reused by a later ordinary call.
            pipe(height=height, width=width, generator=torch.Generator("cpu").manual_seed(0), **call_kwargs)
            seconds, loaded = time.perf_counter() - start, compile_cache.HITS[0] - hits
            results.append(WarmupResult(height, width, seconds, _graphs_compiled() - before, loaded))
    finally:
        pipe._progress_bar_config = saved_bar
    return results


class _GraphBreaks:
    """A module's ``fullgraph=True`` compiled call that, when the trace meets a graph break (data-dependent code such
    as ``mask.tolist()``), raises naming the break (``strict``) or compiles the module with breaks and warns once,
    naming every break dynamo recorded and what it costs."""

    def __init__(self, pipe: Any, name: str, module: Any, options: dict, strict: bool) -> None:
        self.label = f"{type(pipe).__name__}.{name} ({type(module).__name__})"
        self.module, self.options, self.strict = module, options, strict
        self.compiled = module._compiled_call_impl
        self.breaks: list[str] | None = None  # None while the module compiles as one graph

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch
        from torch._dynamo.exc import Unsupported, UserError

        if self.breaks is not None:
            return self.compiled(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except (Unsupported, UserError) as err:  # a graph break; a guard on a value read from the device
            lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()] or [type(err).__name__]
            first = next((line for line in lines if line.startswith("Caused by:")), lines[0])
            if self.strict:
                raise HfTpuRuntimeError(
                    f"compile_pipeline(strict=True): {self.label} cannot be compiled as one graph: {first}. Each "
                    f"graph break makes every step wait for the host; rewrite the data-dependent code, or pass "
                    f"strict=False to compile it with breaks."
                ) from err
        from torch._dynamo.utils import counters

        before = dict(counters["graph_break"])
        self.compiled = torch.compile(self.module._call_impl, **{**self.options, "fullgraph": False})
        out = self.compiled(*args, **kwargs)
        self.breaks = [r for r, n in counters["graph_break"].items() if n > before.get(r, 0)] or [first]
        listed = "; ".join(" ".join(r.split())[:200] for r in self.breaks)
        warnings.warn(
            f"hf_tpu: {self.label} cannot be compiled as one graph and was compiled with {len(self.breaks)} graph "
            f"break(s): {listed}. Each break costs a host round trip per step (the step's graphs wait for a value "
            f"from the host); pass compile_pipeline(..., strict=True) to make this an error.",
            stacklevel=2,
        )
        return out


def _call_module(module: Any, args: tuple, kwargs: dict) -> Any:
    """The denoiser call a cached graph captures (what ``nn.Module.compile`` compiles: ``_call_impl``)."""
    return module._call_impl(*args, **kwargs)


def _signature(value: Any) -> Any:
    """What identifies a call's graph: tensor shapes, dtypes and devices; every other value as is."""
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.device.type, value.requires_grad)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_signature(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _signature(v)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))))
    return repr(value)


class _CachedCalls:
    """The denoiser's ``_compiled_call_impl`` with a persistent compile cache: one graph per call signature, loaded
    or compiled ahead of time and stored; anything the cache cannot serve runs the ordinary compiled call."""

    def __init__(self, module: Any, name: str, space: Any, backend: Any, fallback: Any) -> None:
        self.module, self.name, self.space, self.backend, self.fallback = module, name, space, backend, fallback
        self.graphs: dict[str, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from hf_tpu.compile_cache import StaleGraphError

        graph_id = repr(_signature((args, kwargs)))
        fn = self.graphs.get(graph_id, _UNSET)
        if fn is _UNSET:
            shapes = [tuple(a.shape) for a in (*args, *kwargs.values()) if hasattr(a, "shape")][:2]
            describe = f"{self.name} graph for inputs {shapes}"
            fn = self.space.load_or_compile(graph_id, _call_module, self.backend, (self.module, args, kwargs), describe)
            self.graphs[graph_id] = fn
        if fn is not None:
            try:
                return fn(self.module, args, kwargs)
            except StaleGraphError:
                self.graphs[graph_id] = None
        return self.fallback(*args, **kwargs)


def _attach_cache(pipe: Any, name: str, module: Any, cache: Any) -> None:
    """Serve ``module``'s compiled calls from ``cache`` (idempotent; a new cache replaces the old one)."""
    import hashlib
    import json

    import diffusers

    current = module._compiled_call_impl
    if isinstance(current, _CachedCalls):
        if current.space.cache is cache:
            return
        current = current.fallback
    options = getattr(module, _MARK)
    cls = type(module)
    config = dict(getattr(module, "config", {}) or {})
    parts = {
        "diffusers": diffusers.__version__,
        "pipeline": f"{type(pipe).__module__}.{type(pipe).__qualname__}",
        "component": name,
        "module": f"{cls.__module__}.{cls.__qualname__}",
        "config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "dtype": str(getattr(module, "dtype", None)),
        "device": _module_device(module).type,
        "options": repr(sorted(options.items(), key=lambda kv: kv[0])),
        "source": hashlib.sha256(inspect.getsource(_call_module).encode()).hexdigest(),
    }
    space = cache.namespace("diffusers", parts)
    if space is None:
        return
    module._compiled_call_impl = _CachedCalls(module, name, space, options["backend"], current)
