"""Encoders on TPU: a bucketed, compiled forward for BERT-like models, their pipelines and sentence-transformers.

With :func:`hf_tpu.enable`, a BERT, RoBERTa, XLM-R, ModernBERT, DistilBERT, ELECTRA, DeBERTa-v2 or MPNet model (the
base model and its heads: embeddings, classification, token classification, reranking) placed on the TPU pads every call to a ladder of lengths and batch
sizes, compiles one graph per bucket with the ``"tpu"`` backend and returns the outputs sliced back to the call's
own rows and tokens, equal to upstream's. ``model(**batch)``, ``pipeline("feature-extraction", device="tpu")`` and
``SentenceTransformer(path, device="tpu").encode(...)`` all take that path; :func:`warmup` compiles the ladder ahead.
Calls it cannot serve (labels, ``output_attentions``, training mode, ...) run upstream's eager forward and say why
once. Importing this package imports nothing heavy; the submodules import torch and transformers.

Example:
    >>> import hf_tpu.encoders
    >>> sorted(hf_tpu.encoders.MODEL_TYPES)
    ['bert', 'deberta-v2', 'distilbert', 'electra', 'modernbert', 'mpnet', 'roberta', 'xlm-roberta']
"""

from __future__ import annotations

from hf_tpu.encoders._integration import MODEL_TYPES, serves
from hf_tpu.encoders._state import DEFAULT_BATCH_SIZES, EncoderRecompileError, configure, state
from hf_tpu.encoders.route import EncoderRoute
from hf_tpu.encoders.warmup import EncoderWarmupReport, warmup

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "MODEL_TYPES",
    "EncoderRecompileError",
    "EncoderRoute",
    "EncoderWarmupReport",
    "compiled_graphs",
    "configure",
    "explain",
    "serves",
    "warmup",
]


def explain(model, *args, **kwargs) -> EncoderRoute:
    """Which path ``model(*args, **kwargs)`` takes on the TPU, and why.

    Args:
        model: an encoder model (see :data:`MODEL_TYPES`).
        *args, **kwargs: what the call would get.

    Returns:
        An :class:`~hf_tpu.encoders.route.EncoderRoute`: ``bucketed`` (and the buckets) or not, with ``reason``.

    Raises:
        TypeError: arguments the model's forward does not take (as the call would).
    """
    from hf_tpu.encoders import forward, route

    upstream = type(model).forward
    upstream = getattr(upstream, "__hf_tpu_upstream__", upstream)
    return route.decide(model, upstream, forward.bind(upstream, model, args, kwargs))


def compiled_graphs(model) -> list[tuple]:
    """The encoder graphs compiled for ``model`` so far, in order: ``(batch bucket, length bucket, inputs,
    output_hidden_states, grad_enabled)`` each (one compile each, on the TPU; none twice).

    Args:
        model: an encoder model (see :data:`MODEL_TYPES`).

    Returns:
        One key tuple per compiled graph, in compile order ([] before the first bucketed call).

    Example:
        >>> [key[:2] for key in compiled_graphs(model)]                                 # doctest: +SKIP
        [(1, 16), (1, 32)]
    """
    return list(state(model).compile_log)
