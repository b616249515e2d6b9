"""The ``serving`` integration: transformers' continuous batching (``generate_batch``, ``init_continuous_batching``,
``transformers serve --continuous-batching``) on TPU-placed models with static step shapes.

Patches (all through :func:`hf_tpu._patch.patch`, written for transformers 5.24, reverted by :func:`hf_tpu.disable`);
each one calls upstream unchanged when the model is not on a ``tpu`` device:

* ``ContinuousBatchingManager.__init__``: completes the continuous-batching config (:func:`~._runner.tpu_config`);
* ``ModelRunner.maybe_pad_inputs``: pads every step to the step ladder (:mod:`hf_tpu.serving.ladder`);
* ``ModelRunner.compute_batch``: hands the forward shape-determined integers only, and serves the step graphs from
  the persistent compile cache when there is one (:mod:`~hf_tpu.serving._step_graphs`);
* ``ModelRunner.warmup``: compiles every rung pair of the ladder;
* ``PagedAttentionCache.update``: traced by dynamo on a ``tpu`` cache (one graph per step shape, not pieces between
  the layers' cache updates).
"""

from __future__ import annotations

import functools

from hf_tpu._patch import patch

__all__ = ["FEATURE", "apply"]

FEATURE = "serving"
_VERSIONS = ">=5.24,<5.25"


def _unwrap(owner, name):
    fn = owner.__dict__[name]
    return getattr(fn, "__hf_tpu_upstream__", fn)


def apply() -> None:
    from transformers.generation.continuous_batching import cache, continuous_api, model_runner

    from hf_tpu.serving import _runner, _step_graphs

    manager_cls = continuous_api.ContinuousBatchingManager
    runner_cls = model_runner.ModelRunner
    init = _unwrap(manager_cls, "__init__")
    pad = _unwrap(runner_cls, "maybe_pad_inputs")
    compute = _unwrap(runner_cls, "compute_batch")
    warm = _unwrap(runner_cls, "warmup")
    cache_cls = cache.PagedAttentionCache
    cache_update = _unwrap(cache_cls, "update")

    @functools.wraps(init)
    def __init__(self, model, generation_config, continuous_batching_config, workload_hints=None):
        if _runner._is_tpu(getattr(model, "device", None)):
            continuous_batching_config = _runner.tpu_config(model, continuous_batching_config)
        init(self, model, generation_config, continuous_batching_config, workload_hints)

    @functools.wraps(pad)
    def maybe_pad_inputs(self, num_q_tokens, max_kv_read, use_decode_fast_path):
        if _runner._is_tpu(self.cache.device) and self.pad_inputs and not use_decode_fast_path:
            return _runner.pad_inputs(self, num_q_tokens, max_kv_read)
        return pad(self, num_q_tokens, max_kv_read, use_decode_fast_path)

    @functools.wraps(compute)
    def compute_batch(self, model, batch_data):
        if _runner._is_tpu(self.cache.device) and self.pad_inputs:
            _runner.normalize_step(self, batch_data)
            _step_graphs.install(self, model)
            with _runner.compile_limits():
                return compute(self, model, batch_data)
        return compute(self, model, batch_data)

    @functools.wraps(warm)
    def warmup(self, model):
        if _runner._is_tpu(self.cache.device) and self.pad_inputs:
            import torch

            with torch.no_grad():
                return _runner.warm_all_shapes(self, model)
        return warm(self, model)

    update = _step_graphs.update(cache_update)
    for owner, name, fn, original in (
        (cache_cls, "update", update, cache_update),
        (manager_cls, "__init__", __init__, init),
        (runner_cls, "maybe_pad_inputs", maybe_pad_inputs, pad),
        (runner_cls, "compute_batch", compute_batch, compute),
        (runner_cls, "warmup", warmup, warm),
    ):
        fn.__hf_tpu_upstream__ = original
        patch(owner, name, fn, feature=FEATURE, package="transformers", versions=_VERSIONS)
