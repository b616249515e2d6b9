"""The ``serving`` integration: transformers' continuous batching (``generate_batch``, ``init_continuous_batching``,
``transformers serve --continuous-batching``) on TPU-placed models with static step shapes.

Patches (all through :func:`hf_tpu._patch.patch`, written for transformers 5.24 and 5.25, whose continuous-batching
functions below take the same parameters; reverted by :func:`hf_tpu.disable`); each one calls upstream unchanged when
the model is not on a ``tpu`` device, and each wrapper is checked against upstream's parameters when it is applied
(:func:`hf_tpu._patch.check_parameters`: a release that changed one is named, with the parameters found, before
anything is patched):

* ``ContinuousBatchingManager.__init__``: completes the continuous-batching config (:func:`~._runner.tpu_config`);
  holds back upstream's "RepetitionPenaltyLogitsProcessor isn't supported by CB. Dropping it." (and the same for
  ``min_new_tokens``) and 5.25's "penalty only to newly generated tokens" warning, false when the row sampling
  applies them (said after all with async batching);
* ``ModelRunner.maybe_pad_inputs``: pads every step to the step ladder (:mod:`hf_tpu.serving.ladder`);
* ``ModelRunner.compute_batch``: hands the forward shape-determined integers only, and serves the step graphs from
  the persistent compile cache when there is one (:mod:`~hf_tpu.serving._step_graphs`);
* ``ModelRunner.warmup``: compiles every rung pair of the ladder;
* ``ModelRunner._forward_process_and_sample``, ``ContinuousBatchingIOs._setup_static_tensors`` and
  ``prepare_batch_update``: per-request sampling and log-probabilities inside the step
  (:mod:`~hf_tpu.serving._sampling`; the manager's logits processing becomes its ``RowSampling``, unless async
  batching is on);
* ``ContinuousBatchingIOs._setup_static_tensors`` (again), ``_reset_static_tensors`` and ``get_model_kwargs``: with
  ``RowSampling`` on a ``tpu`` device, the step's inputs are prepared on the host and sent in one copy per step, the
  attention mask made in the step graph (:mod:`~hf_tpu.serving._staging`);
* ``PagedAttentionCache.update``: traced by dynamo on a ``tpu`` cache (one graph per step shape, not pieces between
  the layers' cache updates);
* ``Scheduler._get_waiting_candidates``: with ``RowSampling``, admits a waiting request only when the per-request
  table of penalties has rows for it and its choices (:func:`~._penalties.admit`);
* ``ContinuousBatchingManager._generation_loop_body``: decode-only steps run in chunks of ``read_back_every`` steps
  with one read-back each (:mod:`~hf_tpu.serving._chunks`).
"""

from __future__ import annotations

import functools
import logging
import warnings

from hf_tpu._patch import check_parameters, patch

__all__ = ["FEATURE", "apply"]

FEATURE = "serving"
_VERSIONS = ">=5.24,<5.26"


def _unwrap(owner, name):
    fn = owner.__dict__[name]
    return getattr(fn, "__hf_tpu_upstream__", fn)


#: Processors upstream's continuous batching drops ("isn't supported by CB. Dropping it.") that hf_tpu's row
#: sampling applies per request (:mod:`hf_tpu.serving._penalties`): the warning would be false, so it is held back.
_APPLIED_PER_ROW = ("RepetitionPenaltyLogitsProcessor", "MinNewTokensLengthLogitsProcessor")


class _held_back(logging.Filter):
    """Hold back, while the block runs, upstream's "Processor X isn't supported by CB. Dropping it." for the
    processors ``names`` and, when the repetition penalty is one of them, transformers 5.25's warning that a penalty
    "with `inputs_embeds` and without `input_ids`" applies to new tokens only (continuous batching builds its
    processors without a prompt; hf_tpu's row sampling applies the penalty over each request's prompt too).
    :meth:`release` says them after all (when hf_tpu does not apply them); other warnings pass as they came."""

    _PENALTY_WARNING = "Passing `repetition_penalty` with `inputs_embeds` and without `input_ids`"

    def __init__(self, names) -> None:
        super().__init__()
        self.names, self.records, self.warned = tuple(names), [], []
        self.logger = logging.getLogger("ContinuousBatchingLogger")  # transformers' continuous_batching/utils.py

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.endswith("isn't supported by CB. Dropping it.") and any(f" {n} " in message for n in self.names):
            self.records.append(record)
            return False
        return True

    def __enter__(self):
        self.logger.addFilter(self)
        self._catching = warnings.catch_warnings(record=True)
        self._caught = self._catching.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *_exc) -> None:
        self.logger.removeFilter(self)
        self._catching.__exit__(*_exc)
        for w in self._caught:
            if "RepetitionPenaltyLogitsProcessor" in self.names and str(w.message).startswith(self._PENALTY_WARNING):
                self.warned.append(w)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)

    def release(self) -> None:
        for record in self.records:
            self.logger.handle(record)
        for w in self.warned:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        self.records.clear()
        self.warned.clear()


def apply() -> None:
    from transformers.generation.continuous_batching import (
        cache,
        continuous_api,
        input_outputs,
        model_runner,
        scheduler,
    )

    from hf_tpu.serving import _chunks, _grammar, _penalties, _runner, _sampling, _staging, _step_graphs

    manager_cls = continuous_api.ContinuousBatchingManager
    runner_cls = model_runner.ModelRunner
    init = _unwrap(manager_cls, "__init__")
    pad = _unwrap(runner_cls, "maybe_pad_inputs")
    compute = _unwrap(runner_cls, "compute_batch")
    warm = _unwrap(runner_cls, "warmup")
    cache_cls = cache.PagedAttentionCache
    cache_update = _unwrap(cache_cls, "update")
    io_cls = input_outputs.ContinuousBatchingIOs
    setup = _unwrap(io_cls, "_setup_static_tensors")
    reset_static = _unwrap(io_cls, "_reset_static_tensors")
    model_kwargs = _unwrap(io_cls, "get_model_kwargs")
    batch_update = _unwrap(io_cls, "prepare_batch_update")
    process_and_sample = _unwrap(runner_cls, "_forward_process_and_sample")
    scheduler_cls = scheduler.Scheduler
    candidates = _unwrap(scheduler_cls, "_get_waiting_candidates")
    loop_body = _unwrap(manager_cls, "_generation_loop_body")

    @functools.wraps(init)
    def __init__(self, model, generation_config, continuous_batching_config, workload_hints=None):
        tpu = _runner._is_tpu(getattr(model, "device", None))
        if tpu:
            continuous_batching_config = _runner.tpu_config(model, continuous_batching_config)
        with _held_back(_APPLIED_PER_ROW if tpu else ()) as held:
            init(self, model, generation_config, continuous_batching_config, workload_hints)
        if tpu and not self.continuous_batching_config.use_async_batching:
            top_n = _runner.SETTINGS.max_logprobs
            capacity = _runner.SETTINGS.max_active or 4 * self.continuous_batching_config.max_requests_per_batch
            vocab = _penalties.vocab_of(model)
            table = _penalties.RequestTable(capacity, vocab, model.device)
            slots = self.continuous_batching_config.max_requests_per_batch
            grammar = _grammar.GrammarRows(slots, vocab, model.device)
            self.logit_processor = _sampling.RowSampling(self.logit_processor, generation_config, top_n, table,
                                                         grammar)  # fmt: skip
        else:
            held.release()  # async batching: upstream's drop stands, and so does its warning
        if tpu:
            self._hf_tpu_read_back_every = max(1, int(_runner.SETTINGS.read_back_every))

    @functools.wraps(setup)
    def _setup_static_tensors(self, logit_processor):
        setup(self, logit_processor)
        if isinstance(logit_processor, _sampling.RowSampling):  # room for the log-probabilities
            import torch

            shape = (logit_processor.output_rows, self.output_ids.shape[1])
            self.output_ids = torch.zeros(shape, dtype=torch.int32, device=self.output_ids.device)
            self._hf_tpu_row_sampling = True
            self.cache._hf_tpu_table = logit_processor.table  # (the scheduler admits by its free rows)
            if _runner._is_tpu(self.output_ids.device):
                _staging.install(self)

    @functools.wraps(reset_static)
    def _reset_static_tensors(self, full_reset=False):
        return _staging.reset(self, full_reset, reset_static)

    @functools.wraps(model_kwargs)
    def get_model_kwargs(self, use_padding=False):
        return _staging.model_kwargs(self, use_padding, model_kwargs)

    @functools.wraps(batch_update)
    def prepare_batch_update(self):
        if getattr(self, "_hf_tpu_row_sampling", False):
            return _sampling.batch_update(self, batch_update)
        return batch_update(self)

    @functools.wraps(process_and_sample)
    def _forward_process_and_sample(self, model, batch_data, carry_over_ids, prev_output_ids, output_ids):
        if isinstance(self.logit_processor, _sampling.RowSampling):
            return _sampling.step(self, model, batch_data, carry_over_ids, prev_output_ids, output_ids)
        return process_and_sample(self, model, batch_data, carry_over_ids, prev_output_ids, output_ids)

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

    @functools.wraps(candidates)
    def _get_waiting_candidates(self):
        ordered = candidates(self)
        table = getattr(self.cache, "_hf_tpu_table", None)
        return ordered if table is None else _penalties.admit(self, ordered, table)

    @functools.wraps(loop_body)
    def _generation_loop_body(self, batch_processor, bootstrapping):
        if "_hf_tpu_read_back_every" in self.__dict__:
            return _chunks.loop_body(self, batch_processor, bootstrapping, loop_body)
        return loop_body(self, batch_processor, bootstrapping)

    update = _step_graphs.update(cache_update)
    wrappers = (
        (cache_cls, "update", update, cache_update),
        (manager_cls, "__init__", __init__, init),
        (runner_cls, "maybe_pad_inputs", maybe_pad_inputs, pad),
        (runner_cls, "compute_batch", compute_batch, compute),
        (runner_cls, "warmup", warmup, warm),
        (runner_cls, "_forward_process_and_sample", _forward_process_and_sample, process_and_sample),
        (io_cls, "_setup_static_tensors", _setup_static_tensors, setup),
        (io_cls, "_reset_static_tensors", _reset_static_tensors, reset_static),
        (io_cls, "get_model_kwargs", get_model_kwargs, model_kwargs),
        (io_cls, "prepare_batch_update", prepare_batch_update, batch_update),
        (scheduler_cls, "_get_waiting_candidates", _get_waiting_candidates, candidates),
        (manager_cls, "_generation_loop_body", _generation_loop_body, loop_body),
    )
    for owner, name, fn, _original in wrappers:  # all checked before any is patched
        check_parameters(owner, name, fn, feature=FEATURE, package="transformers", versions=_VERSIONS)
    for owner, name, fn, original in wrappers:
        fn.__hf_tpu_upstream__ = original
        patch(owner, name, fn, feature=FEATURE, package="transformers", versions=_VERSIONS)
