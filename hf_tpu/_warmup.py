"""``hf_tpu.warmup``: compile ahead of time what a model's calls will need, whichever integration serves it.

An encoder the ``encoders`` integration serves (BERT, RoBERTa, XLM-R, ModernBERT, ...) gets its bucketed forward's
graphs (:func:`hf_tpu.encoders.warmup`); any other model gets ``generate``'s graphs
(:func:`hf_tpu.transformers.warmup.warmup`). The two integrations do not know each other: this facade, above both,
is the one place that picks.

Example:
    >>> import hf_tpu                                                                        # doctest: +SKIP
    >>> hf_tpu.warmup(model, max_prompt_len=256, batch_sizes=[1, 4], max_new_tokens=64)       # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from hf_tpu.errors import InvalidTypeError

__all__ = ["warmup"]

# The generation warm-up's options beyond those both warm-ups take.
_GENERATION_OPTIONS = {"num_beams", "image_sizes", "num_images", "generate_kwargs"}


def warmup(
    model,
    max_prompt_len: int = 128,
    batch_sizes: Iterable[int] = (1,),
    max_new_tokens: int = 32,
    *,
    buckets: Iterable[int] | None = None,
    strict: bool | str | None = None,
    progress: bool = True,
    cache_dir: str | os.PathLike | None = None,
    **generation: Any,
):
    """Compile the graphs ``model``'s later calls will use, so that serving compiles nothing.

    Args:
        model: a model on the TPU (``device_map="tpu"`` or ``.to("tpu")``).
        max_prompt_len: every length bucket up to the one holding this length is compiled (an encoder's
            ``max_length``).
        batch_sizes: the batch sizes to compile for.
        max_new_tokens: the largest ``max_new_tokens`` later ``generate`` calls use (no part for an encoder).
        buckets, strict, progress, cache_dir: the ladder, strict mode, a progress bar and the persistent compile
            cache (see :func:`hf_tpu.transformers.warmup.warmup`; an encoder takes no ``cache_dir``).
        **generation: the generation warm-up's other options (``num_beams``, ``image_sizes``, ``num_images``,
            ``generate_kwargs``); an encoder has none of them and they play no part for it.

    Returns:
        For an encoder, the :class:`~hf_tpu.encoders.EncoderWarmupReport` of :func:`hf_tpu.encoders.warmup` with
        ``max_length = max_prompt_len``; otherwise the :class:`~hf_tpu.transformers.warmup.WarmupReport` of
        :func:`hf_tpu.transformers.warmup.warmup`.

    Raises:
        hf_tpu.errors.UserError: ``cache_dir`` given for an encoder (the compile cache holds no encoder graphs yet).
        TypeError (InvalidTypeError): a keyword argument neither warm-up takes.
        Whatever the chosen warm-up raises (a model not on the TPU, bad batch sizes, ...).
    """
    from hf_tpu.encoders import serves

    unknown = set(generation) - _GENERATION_OPTIONS
    if unknown:  # (as a call of the generation warm-up would, for an encoder too)
        raise InvalidTypeError(f"hf_tpu.warmup() got unexpected keyword argument(s) {', '.join(sorted(unknown))}")
    if serves(model):  # an encoder (BERT-like): its graphs are the bucketed forward's
        return _warm_encoder(model, max_prompt_len, batch_sizes, buckets, strict, progress, cache_dir)

    from hf_tpu.transformers.warmup import warmup as warm_generation

    return warm_generation(
        model, max_prompt_len, batch_sizes, max_new_tokens,
        buckets=buckets, strict=strict, progress=progress, cache_dir=cache_dir, **generation,
    )  # fmt: skip


def _warm_encoder(model, max_prompt_len, batch_sizes, buckets, strict, progress, cache_dir):
    """:func:`hf_tpu.encoders.warmup` for ``hf_tpu.warmup(encoder, ...)``."""
    from hf_tpu.encoders import warmup as warm_encoder
    from hf_tpu.errors import UserError

    if cache_dir is not None:
        raise UserError(
            "hf_tpu.warmup(encoder, cache_dir=...): the persistent compile cache does not hold encoder graphs yet; "
            "warm up without cache_dir (each process compiles its buckets once)"
        )
    strict = None if strict is None else bool(strict)
    return warm_encoder(model, max_prompt_len, batch_sizes, lengths=buckets, strict=strict, progress=progress)
