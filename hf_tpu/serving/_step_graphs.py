"""The continuous-batching step as one graph per step shape, served from hf_tpu's persistent compile cache.

Upstream (transformers 5.24) compiles its step (``ModelRunner._forward_process_and_sample``: forward, logits
processing, sampling) with ``torch.compile`` and wraps the paged-cache update in ``torch.compiler.disable``, so the
step is compiled in pieces between the layers' cache updates. On a ``tpu`` cache, hf_tpu traces the update
(:func:`update`: upstream's own function, without the ``disable``): the step of one ``(query tokens, KV tokens
read)`` shape is one graph. (Not under tensor parallelism: there the step stays in pieces and is not cached.)

With a compile cache (``hf_tpu.serving.configure(compile_cache=...)``, ``hf-tpu serve --compile-cache DIR`` or
``HF_TPU_COMPILE_CACHE``), each step shape's graph is compiled ahead of time and stored
(:meth:`hf_tpu.compile_cache.Namespace.load_or_compile`), and a later process loads it instead of compiling: its
warm-up compiles nothing. A graph the cache cannot serve is reported (``CompileCacheWarning``) and compiled by
upstream's ``torch.compile`` as usual.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import weakref
from typing import Any

__all__ = ["StepGraphs", "install", "step", "update"]


def _upstream_step():
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    return ModelRunner._forward_process_and_sample


def step(runner, model, batch_data, carry_over_ids, prev_output_ids, output_ids) -> None:
    """Upstream's step (forward, logits processing, sampling into ``output_ids``) as a plain function of its inputs,
    the runner included, so that a compiled graph of it can be stored and loaded in another process."""
    return _upstream_step()(runner, model, batch_data, carry_over_ids, prev_output_ids, output_ids)


def update(upstream_update):
    """``PagedAttentionCache.update`` that dynamo traces on a ``tpu`` cache of a model that is not sharded
    (upstream's function without its ``torch.compiler.disable``; :func:`install` marks the cache), upstream's
    unchanged elsewhere. Under tensor parallelism the update stays out of the graph: AOTAutograd refuses mutated
    aliased inputs (the cache's views) in a graph with tensor subclasses (the sharded weights)."""
    traced = getattr(upstream_update, "__wrapped__", upstream_update)

    @functools.wraps(traced)
    def _update(self, key_states, value_states, layer_idx, kwargs):
        if getattr(self, "_hf_tpu_traced_update", False):
            return traced(self, key_states, value_states, layer_idx, kwargs)
        return upstream_update(self, key_states, value_states, layer_idx, kwargs)

    return _update


def _namespace(cache, runner, model):
    """Everything a step graph depends on besides its shape and the weights."""
    from transformers.generation.continuous_batching import input_outputs, model_runner

    from hf_tpu.compile_cache import model_identity
    from hf_tpu.serving import _grammar, _penalties, _runner, _sampling, _staging

    cb = runner.cb_config
    compile_config = cb.varlen_compile_config
    modules = (inspect.getmodule(step), _runner, _sampling, _penalties, _grammar, _staging, model_runner,
               input_outputs)  # fmt: skip
    source = "".join(inspect.getsource(m) for m in modules)
    parts = {
        **model_identity(model),
        "ladder": [list(r) for r in (_runner.ladder_of(runner).q_rungs, _runner.ladder_of(runner).kv_rungs)],
        "cache": [runner.cache.num_blocks, cb.page_size, runner.cache.max_batch_tokens],
        "slots": cb.max_requests_per_batch,
        "io": type(runner.inputs_and_outputs).__name__,
        "sampling": [runner.do_sample, runner.return_logprobs, _processors(runner.logit_processor)],
        "backend": getattr(compile_config, "backend", "tpu"),
        "source": hashlib.sha256(source.encode()).hexdigest(),
    }
    return cache.namespace("continuous-batching", parts)


def _processors(cb_processors) -> list:
    """The logits processors by class and plain settings (their default repr holds memory addresses)."""
    plain = (bool, int, float, str, type(None))
    return [
        [type(p).__name__, {k: v for k, v in sorted(vars(p).items()) if isinstance(v, plain)}]
        for p in getattr(cb_processors, "logits_processor", ())
    ] + [getattr(cb_processors, "tensors_required", None), getattr(cb_processors, "top_n", None)]


class StepGraphs:
    """A runner's varlen forward: per step shape, the graph from the compile cache (loaded, or compiled ahead of
    time and stored), else upstream's compiled step.

    It is kept off the runner (in :data:`_STATE`): dynamo serializes what it reaches from the runner, an input of
    every step graph, and a loaded graph cannot be serialized; the runner holds only :func:`_forward`."""

    def __init__(self, runner, cache, fallback) -> None:
        self.cache, self.fallback = cache, fallback
        self.space: Any = None
        self.graphs: dict[tuple[int, int], Any] = {}

    def __call__(self, runner, model, batch_data, carry_over_ids, prev_output_ids, output_ids) -> None:
        args = (runner, model, batch_data, carry_over_ids, prev_output_ids, output_ids)
        reads = batch_data.get("read_index") or []
        key = (batch_data["input_ids"].shape[-1], reads[0].shape[0] if reads else 0)
        if key not in self.graphs:
            if self.space is None:
                self.space = _namespace(self.cache, runner, model) or False
            q, kv = key
            describe = f"continuous-batching step graph for {q} query tokens, {kv} KV tokens"
            backend = getattr(runner.cb_config.varlen_compile_config, "backend", None) or "tpu"
            graph = self.space.load_or_compile(repr(key), step, backend, args, describe) if self.space else None
            self.graphs[key] = graph
        fn = self.graphs[key]
        if fn is not None:
            from hf_tpu.compile_cache import StaleGraphError

            try:
                return fn(*args)
            except StaleGraphError:
                self.graphs[key] = None
        return self.fallback(model, batch_data, carry_over_ids, prev_output_ids, output_ids)


_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def install(runner, model) -> None:
    """Once per runner: trace the cache update (one graph per step shape) unless the model is sharded, and serve the
    varlen step from the compile cache when there is one."""
    if runner in _STATE:
        return
    from hf_tpu.serving._runner import compile_cache

    sharded = getattr(model, "_device_mesh", None) is not None
    runner.cache._hf_tpu_traced_update = not sharded
    cache = compile_cache()
    if cache is None or sharded or runner._compiled_varlen is None:
        _STATE[runner] = None
        return
    _STATE[runner] = StepGraphs(runner, cache, runner._compiled_varlen)
    runner._compiled_varlen = functools.partial(_forward, weakref.ref(runner))


def _forward(runner_ref, model, batch_data, carry_over_ids, prev_output_ids, output_ids) -> None:
    runner = runner_ref()
    return _STATE[runner](runner, model, batch_data, carry_over_ids, prev_output_ids, output_ids)
