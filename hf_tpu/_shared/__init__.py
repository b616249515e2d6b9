"""What the integrations share, below all of them: shape buckets, per-model state, strict mode, one-time notes.

Generation (:mod:`hf_tpu.transformers`) and the bucketed encoder forward (:mod:`hf_tpu.encoders`) both pad calls to
a ladder of shapes, keep their state on the model object, turn a compile after warm-up into an error when asked and
say each fallback once. Those pieces live here so that neither integration imports the other; the facade
:func:`hf_tpu.warmup` (:mod:`hf_tpu._warmup`) picks the encoder or the generation warm-up. Nothing here imports an
integration.

- :mod:`hf_tpu._shared.buckets`: :class:`~hf_tpu._shared.buckets.BucketLadder` and the default ladders;
- :mod:`hf_tpu._shared.state`: per-model state on ``model.__dict__`` and the ``HF_TPU_STRICT_COMPILE`` switch;
- :mod:`hf_tpu._shared.notes`: :func:`~hf_tpu._shared.notes.warn_once`.
"""
