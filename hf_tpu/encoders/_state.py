"""Per-model settings and state of the bucketed encoder forward: its ladders, strict mode, what it compiled.

A leaf module (it imports nothing of hf_tpu's beyond the layer the integrations share, :mod:`hf_tpu._shared`), read by the route, the forward and
the warm-up. The state lives in the model's ``__dict__`` (as generation's does), so it goes when the model goes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from hf_tpu._shared.buckets import BucketLadder, default_ladder
from hf_tpu._shared.state import STRICT_ENV, attached, strict_from_env
from hf_tpu.errors import HfTpuError, UserError

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "STRICT_ENV",
    "EncoderRecompileError",
    "EncoderState",
    "configure",
    "state",
]

# One graph per (batch bucket, length bucket): rows are padded to the next power of two up to 128.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


class EncoderRecompileError(HfTpuError, RuntimeError):
    """Strict mode: an encoder call needed a graph that warm-up did not compile."""


@dataclass
class EncoderState:
    """What hf_tpu keeps for one encoder model: the ladders, strict mode, the graph keys compiled, and why the
    model cannot take the fast path at all (``problem``, found once: a forward that is not one graph, an output
    whose padding cannot be undone)."""

    lengths: BucketLadder | None = None
    batch_sizes: BucketLadder = field(default_factory=lambda: BucketLadder(DEFAULT_BATCH_SIZES))
    strict: bool | None = None
    bucketed: bool = True
    warmed: bool = False
    compiled: set[tuple] = field(default_factory=set)
    compile_log: list[tuple] = field(default_factory=list)
    problem: str | None = None

    def length_ladder(self, config) -> BucketLadder:
        """The sequence-length ladder: the configured one, else :func:`default_ladder` of the config (powers of two
        from 16, then steps of 256, up to ``max_position_embeddings``)."""
        return self.lengths if self.lengths is not None else default_ladder(config)

    def is_strict(self) -> bool:
        if self.strict is not None:
            return self.strict
        return bool(strict_from_env())  # (HF_TPU_STRICT_COMPILE, as generation reads it; "eager" counts as on)


def state(model) -> EncoderState:
    """The model's :class:`EncoderState` (made on first use)."""
    return attached(model, "_hf_tpu_encoder", EncoderState)


def configure(
    model,
    *,
    lengths: BucketLadder | Iterable[int] | None = None,
    batch_sizes: BucketLadder | Iterable[int] | None = None,
    strict: bool | None = None,
    bucketed: bool | None = None,
) -> EncoderState:
    """Set the ladders and strict mode of ``model``'s bucketed encoder forward.

    Args:
        model: a transformers encoder (BERT, RoBERTa, XLM-R, ModernBERT, DistilBERT, ELECTRA, DeBERTa-v2, MPNet and
            their heads).
        lengths: sequence lengths inputs are padded up to (default: :func:`hf_tpu._shared.buckets.default_ladder`
            of the config, 16, 32, ... up to ``max_position_embeddings``).
        batch_sizes: row counts batches are padded up to (default :data:`DEFAULT_BATCH_SIZES`).
        strict: True: after :func:`hf_tpu.encoders.warmup`, a call that needs a graph warm-up did not compile raises
            :class:`EncoderRecompileError` instead of compiling (default: ``HF_TPU_STRICT_COMPILE``).
        bucketed: False: this model's calls run upstream's eager forward (the bucketed path is off for it alone).

    Returns:
        The model's :class:`EncoderState`.

    Raises:
        hf_tpu.errors.UserError: a ladder with no positive length.

    Example:
        >>> from hf_tpu.encoders import configure                                        # doctest: +SKIP
        >>> configure(model, lengths=[32, 64, 128], batch_sizes=[1, 8, 32], strict=True)  # doctest: +SKIP
    """
    found = state(model)
    try:
        if lengths is not None:
            found.lengths = BucketLadder.coerce(lengths)
        if batch_sizes is not None:
            found.batch_sizes = BucketLadder.coerce(batch_sizes)
    except ValueError as exc:
        raise UserError(f"hf_tpu.encoders.configure: {exc}") from None
    if strict is not None:
        found.strict = bool(strict)
    if bucketed is not None:
        found.bucketed = bool(bucketed)
    return found
