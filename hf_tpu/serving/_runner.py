"""What changes in upstream's continuous batching when the model sits on a ``tpu`` device.

Three places, each a method of transformers' ``ContinuousBatchingManager``/``ModelRunner`` replaced through
:mod:`hf_tpu._patch` (see :mod:`hf_tpu.serving._integration`), each calling upstream unchanged off TPU:

* :func:`tpu_config`: the ``ContinuousBatchingConfig`` the manager resolves gets hf_tpu's values for what the user
  left unset: the step forward compiled with the ``"tpu"`` backend at static shapes, no CUDA graphs, no
  flash-attention decode path, the cache sized by :mod:`hf_tpu.serving.kv_sizing`, ``max_batch_tokens`` from
  :data:`SETTINGS`;
* :func:`pad_inputs`: every step padded to the rungs of :class:`~hf_tpu.serving.ladder.StepLadder` (upstream pads
  to fixed intervals, and only for CUDA graphs or an explicit compile config);
* :func:`normalize_step`: the per-step Python integers upstream hands the forward for flash attention
  (``max_length_k``) set to the padded KV length, so that dynamo does not specialise (and recompile) on them;
* :func:`warm_all_shapes`: warm-up compiles every rung pair, not only the largest.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from typing import Any

from hf_tpu import _env
from hf_tpu.errors import InvalidTypeError
from hf_tpu.serving.ladder import StepLadder

logger = logging.getLogger("hf_tpu.serving")

__all__ = ["SETTINGS", "ServingSettings", "compiled_shapes", "configure"]


@dataclass
class ServingSettings:
    """Defaults hf_tpu gives the continuous-batching config of a TPU model (a value set in the config wins).

    Attributes:
        max_batch_tokens: the largest step (query tokens; longer prompts are prefilled in chunks).
        slots: requests in one step (``max_requests_per_batch``), also the number of full-length requests the KV
            cache is sized for.
        kv_cache_gib: a cap on the KV cache (default: ``HF_TPU_KV_CACHE_GIB``, else none).
        page_size: tokens per KV page (None: upstream's default).
        q_min, q_factor, kv_factor: the step ladder (:meth:`~hf_tpu.serving.ladder.StepLadder.build`).
        compile_cache: where the step graphs are stored and loaded (a directory or a
            :class:`~hf_tpu.compile_cache.CompileCache`; None: ``HF_TPU_COMPILE_CACHE``, else none; False: none).
        max_logprobs: how many most likely tokens (with their log-probabilities) each step returns per row, the
            most a request may ask for (:mod:`hf_tpu.serving._sampling`).
        max_active: requests active at once, each with a row of the per-request penalty table on the device
            (:mod:`hf_tpu.serving._penalties`: 8 bytes per vocabulary entry); more wait. None: 4 x ``slots``.
        read_back_every: the decode-only steps run back to back between two read-backs of their tokens
            (:mod:`hf_tpu.serving._chunks`); 1: a read-back each step (upstream's loop).
        json_whitespace: structured output's JSON (:mod:`hf_tpu.serving._grammar`) may hold any whitespace
            between its tokens, vLLM's default; False: none (vLLM's ``disable_any_whitespace``).
    """

    max_batch_tokens: int = 256
    slots: int = 32
    kv_cache_gib: float | None = None
    page_size: int | None = None
    q_min: int = 16
    q_factor: int = 4
    kv_factor: int = 4
    compile_cache: Any = None
    max_logprobs: int = 5
    max_active: int | None = None
    read_back_every: int = 8
    json_whitespace: bool = True


def configure(**values) -> ServingSettings:
    """Set :data:`SETTINGS` fields by name (for managers created afterwards); returns the settings.

    Args:
        **values: :class:`ServingSettings` field names and their new values (``max_batch_tokens=128``, ...);
            fields not named keep their values.

    Returns:
        :data:`SETTINGS`, the one settings object, changed.

    A ``compile_cache`` directory is opened at once, not at the first manager's warm-up: torch_tpu reads where its own
    caches live at its first compile, and loading a model compiles (on a v5e, the Llama-3.2-1B shape's load made 11
    cache requests before a warm-up opened the cache, so the next server compiled every step graph again).

    Raises:
        TypeError (InvalidTypeError): a name that is not a :class:`ServingSettings` field (the message lists them).

    Example:
        >>> import hf_tpu.serving                                                   # doctest: +SKIP
        >>> hf_tpu.serving.configure(max_batch_tokens=128, kv_cache_gib=1.0)         # doctest: +SKIP
    """
    for name, value in values.items():
        if not hasattr(SETTINGS, name):
            known = ", ".join(ServingSettings.__dataclass_fields__)
            raise InvalidTypeError(f"hf_tpu.serving.configure got an unknown setting {name!r}; known: {known}")
        setattr(SETTINGS, name, value)
    if values.get("compile_cache") not in (None, False):
        compile_cache()
    return SETTINGS


SETTINGS = ServingSettings()
_CACHES: dict[Any, Any] = {}


def compile_cache():
    """The compile cache of :data:`SETTINGS` (``compile_cache``, else ``HF_TPU_COMPILE_CACHE``), or None."""
    from hf_tpu.compile_cache import CompileCache

    value = SETTINGS.compile_cache
    if value is None:
        value = _env.COMPILE_CACHE.get()
    if isinstance(value, (str, os.PathLike)):
        value = os.fspath(value)
        if value not in _CACHES:  # one CompileCache per directory: its problems are reported once
            _CACHES[value] = CompileCache(value)
        return _CACHES[value]
    return CompileCache.coerce(value)


def _is_tpu(device) -> bool:
    return getattr(device, "type", None) == "tpu"


def tpu_config(model, cb_config):
    """A copy of ``cb_config`` (or a new one) completed with hf_tpu's TPU values; see the module docstring."""
    from transformers.generation.configuration_utils import CompileConfig, ContinuousBatchingConfig

    from hf_tpu.serving.kv_sizing import plan_for_model

    cfg = copy.deepcopy(cb_config) if cb_config is not None else ContinuousBatchingConfig()
    if cfg.varlen_compile_config is None and cfg.default_compile_level == 0:
        # fullgraph=False: upstream's paged-cache update is wrapped in torch.compiler.disable (a graph break per
        # layer); the pieces between breaks are compiled, the update runs eagerly at the same padded shapes.
        cfg.varlen_compile_config = CompileConfig(backend="tpu", fullgraph=False, dynamic=False, mode="default")
    cfg.max_blocks_per_request = 0  # the decode fast path needs flash_attn_with_kvcache (CUDA/XPU only)
    cfg.use_cuda_graph = False
    if cfg.use_async_batching is None:
        cfg.use_async_batching = False
    cfg.auto_switch_to_flash = False
    if cfg.max_batch_tokens is None:
        cfg.max_batch_tokens = SETTINGS.max_batch_tokens
    if cfg.max_requests_per_batch is None:
        cfg.max_requests_per_batch = SETTINGS.slots
    if SETTINGS.page_size is not None:
        cfg.page_size = SETTINGS.page_size
    if cfg.num_blocks is None:
        slots, cap = cfg.max_requests_per_batch, SETTINGS.kv_cache_gib
        plan = plan_for_model(model, cfg.page_size, slots=slots, kv_cache_gib=cap)
        cfg.num_blocks = plan.num_blocks
        logger.info(
            "hf_tpu: paged KV cache of %d blocks x %d tokens (%.1f MiB) for %s",
            plan.num_blocks, plan.page_size, plan.bytes / 2**20, plan.why,
        )  # fmt: skip
    return cfg


def ladder_of(runner) -> StepLadder:
    ladder = getattr(runner, "_hf_tpu_ladder", None)
    if ladder is None:
        cache = runner.cache
        ladder = StepLadder.build(
            cache.max_batch_tokens, cache.max_tokens_read, runner.cb_config.page_size, q_min=SETTINGS.q_min,
            q_factor=SETTINGS.q_factor, kv_factor=SETTINGS.kv_factor,
        )  # fmt: skip
        runner._hf_tpu_ladder = ladder
    return ladder


def pad_inputs(runner, num_q_tokens: int, max_kv_read: int) -> tuple[int, int]:
    return ladder_of(runner).pad(num_q_tokens, max_kv_read)


def normalize_step(runner, batch_data: dict) -> None:
    """Give the forward only shape-determined Python integers (dynamo guards on them)."""
    q = batch_data["input_ids"].shape[-1]
    reads = batch_data.get("read_index") or []
    kv = reads[0].shape[0] if reads and reads[0].shape[0] > 0 else q
    batch_data["max_length_q"] = q
    if isinstance(batch_data.get("max_length_k"), dict):
        batch_data["max_length_k"] = dict.fromkeys(batch_data["max_length_k"], kv)
    shapes = runner.__dict__.setdefault("_hf_tpu_shapes", set())
    shapes.add((q, kv - q if reads and reads[0].shape[0] > 0 else 0))


def compiled_shapes(manager_or_model) -> set[tuple[int, int]]:
    """The ``(query tokens, KV tokens read)`` step shapes a continuous-batching manager (or a model's cached one) has
    run so far.

    Args:
        manager_or_model: a continuous-batching manager, or a model whose ``generate_batch`` /
            ``init_continuous_batching`` made one.

    Returns:
        A new set of ``(query tokens, KV tokens read)`` pairs; empty when there is no manager or it ran nothing.
    """
    manager = getattr(manager_or_model, "_cached_continuous_batching_manager", manager_or_model)
    processor = getattr(manager, "batch_processor", None)
    runner = getattr(processor, "model_runner", None)
    return set(getattr(runner, "__dict__", {}).get("_hf_tpu_shapes", set()))


def compile_limits():
    """Dynamo's recompile limits raised for the ladder's shapes (the default of 8 would send later rungs to eager)."""
    import torch

    limits = {"recompile_limit": max(torch._dynamo.config.recompile_limit, 1024)}
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        limits["accumulated_recompile_limit"] = max(torch._dynamo.config.accumulated_recompile_limit, 4096)
    return torch._dynamo.config.patch(**limits)


def warm_all_shapes(runner, model) -> None:
    """Run one step of every rung pair (compiles them), then return the cache to its empty state; a callable
    ``runner._hf_tpu_progress`` hears of each shape as it is done."""
    import time

    start = time.perf_counter()
    ladder = ladder_of(runner)
    # (done, total, (q, kv), seconds), e.g. hf-tpu serve's; taken off the runner, an input of every step graph, whose
    # compile-cache entry serializes what the runner reaches: a callback holding a stream cannot be (hf-tpu serve
    # --compile-cache stored no step graph: "cannot pickle '_io.TextIOWrapper' object", then compiled each again)
    progress = runner.__dict__.pop("_hf_tpu_progress", None)
    for i, (q, kv) in enumerate(ladder.shapes):
        began = time.perf_counter()
        runner.run_one_warmup(model=model, num_q_tokens=q, max_kv_read=kv)
        if progress is not None:
            progress(i + 1, len(ladder.shapes), (q, kv), time.perf_counter() - began)
    runner.cache.reset()
    if not _env.QUIET_WARMUP.get():
        logger.info(
            "hf_tpu: continuous batching warmed up %d step shapes (query rungs %s, KV rungs %s) in %.1f s",
            len(ladder.shapes), list(ladder.q_rungs), list(ladder.kv_rungs), time.perf_counter() - start,
        )  # fmt: skip
