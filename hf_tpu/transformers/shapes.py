"""Shape planning: which prompt bucket and static-cache length a ``generate`` call runs in.

A decoder-only call pads its prompt on the left to the prompt bucket (the first rung of the model's ladder that
holds it, :mod:`hf_tpu.transformers.buckets`) and sizes its static cache to hold the padded prompt plus
``max_new_tokens``, rounded up with :func:`~hf_tpu.transformers.buckets.cache_length` (a multiple of 128 by
default). A cache already compiled for the same prompt bucket that is large enough is preferred to compiling a
smaller one. :func:`plan_shapes` is the public way to ask which shapes a call will use, and :func:`ladder_figures`
measures a ladder (padding, unused cache slots, graphs) through it.

The padding's token id (:func:`fill_id`): upstream's ``generate`` writes the call's ``pad_token_id`` into the
returned sequences only; it never embeds it where a row is not finished. ``pad_token_id=-1`` (transformers' own
tests pass it) or an id past the vocabulary is fine there, but it cannot be embedded: the padding hf_tpu adds to
reach a bucket, and a finished row's input to the next decode step, take :func:`fill_id` instead (masked out, or
never read back), and the sequences keep the caller's pad id.

Example:
    >>> plan_shapes(model, batch=1, prompt_len=500, max_new_tokens=8)      # doctest: +SKIP
    ShapePlan(batch=1, prompt_len=500, prompt_bucket=512, cache_bucket=640, encoder_bucket=None)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hf_tpu.transformers._graph_key import NO_VARIANT, GraphKind, Variant
from hf_tpu.transformers._settings import model_state
from hf_tpu.transformers._upstream import encoder_input_name
from hf_tpu.transformers.buckets import BucketLadder, BucketOverflowError, cache_length

__all__ = ["ShapePlan", "fill_id", "ladder_figures", "plan_shapes"]

# The remedy every length error names (it must exist: tests/transformers/test_remedies.py resolves it).
LADDER_FIX = (
    "truncate the prompt (tokenizer(..., truncation=True, max_length=...)) or give a larger ladder "
    "(hf_tpu.transformers.configure(model, buckets=[...]))"
)


@dataclass(frozen=True)
class ShapePlan:
    """The shapes of one call: its batch, its prompt length and bucket, its cache length (and encoder bucket)."""

    batch: int
    prompt_len: int
    prompt_bucket: int
    cache_bucket: int
    encoder_bucket: int | None = None


def _cache_rungs(ladder: BucketLadder) -> BucketLadder:
    # The ladder-sized cache (cache_multiple=None): a padded prompt plus the new tokens may pass the model's length
    # limit while the real sequence does not; the extra slots are storage only (padding keeps position 0), so the
    # cache ladder has one rung above the top.
    return BucketLadder((*ladder.rungs, 2 * ladder.max))


def _cache_size(state, ladder: BucketLadder, need: int) -> int:
    multiple = state.settings.cache_multiple
    if multiple is None:
        return _cache_rungs(ladder).bucket(need)
    return cache_length(need, multiple)


def plan_shapes(
    model, batch: int, prompt_len: int, max_new_tokens: int, *, encoder_len: int | None = None,
    variant: Variant | str = NO_VARIANT, kind: str = "prefill",
) -> ShapePlan:
    """The buckets a ``generate`` call of this size runs in (prefers shapes already compiled for the model: its
    prefill graphs of base ``kind`` and ``variant``; beam search's are ``"beam_prefill"``). ``variant``: a
    :class:`~hf_tpu.transformers._graph_key.Variant`, or its text (``"+top_k+sample"``, as
    :func:`~hf_tpu.transformers.generation.default_variant` gives it).

    Raises :class:`BucketOverflowError` for a prompt past the largest bucket, or a prompt plus ``max_new_tokens``
    longer than the largest bucket.

    Example:
        >>> plan_shapes(model, batch=1, prompt_len=20, max_new_tokens=32)      # doctest: +SKIP
        ShapePlan(batch=1, prompt_len=20, prompt_bucket=32, cache_bucket=64, encoder_bucket=None)
    """
    state = model_state(model)
    ladder = state.ladder(model.config)
    new = max(int(max_new_tokens), 1)
    if isinstance(variant, str):  # (a caller's text: read at this boundary)
        variant = Variant.parse(variant)
    if encoder_len is not None:
        # Encoder-decoder: the encoder input is bucketed, the decoder prompt (usually the start token) is not.
        # (an encoder of features runs at the length its input fixes: its output's length is the model's own)
        exact = encoder_input_name(model) is not None
        encoder_bucket = encoder_len if exact else ladder.bucket(encoder_len, "the encoder input", LADDER_FIX)
        need = prompt_len + new - 1
        if need > ladder.max:
            raise BucketOverflowError(
                f"the decoder prompt ({prompt_len}) plus max_new_tokens ({new}) needs a cache of {need} tokens, past "
                f"the largest bucket ({ladder.max}): lower max_new_tokens or give a larger ladder "
                "(hf_tpu.transformers.configure(model, buckets=[...]))."
            )
        prefill = GraphKind("seq2seq_prefill", variant)
        compiled = sorted(
            k[4]
            for k in state.compiled
            if k[0] == prefill and k[1:4] == (batch, encoder_bucket, prompt_len) and k[4] >= need
        )
        cache_bucket = compiled[0] if compiled else _cache_size(state, ladder, need)
        return ShapePlan(batch, prompt_len, prompt_len, cache_bucket, encoder_bucket)

    prompt_bucket = ladder.bucket(prompt_len, "the prompt", LADDER_FIX)
    if prompt_len + new - 1 > ladder.max:
        raise BucketOverflowError(
            f"the prompt ({prompt_len} tokens) plus max_new_tokens ({new}) is {prompt_len + new} tokens, past the "
            f"largest bucket ({ladder.max}, the model's length limit unless configured): lower max_new_tokens, "
            "shorten the prompt, or give a larger ladder (hf_tpu.transformers.configure(model, buckets=[...]))."
        )
    need = prompt_bucket + new - 1
    kinds = (GraphKind(kind, variant),)
    if kind == "prefill":
        kinds += (GraphKind("mm_prefill", variant),)  # (an image call's prefill: the same cache shapes)
    compiled = sorted(
        k[3] for k in state.compiled if k[0] in kinds and k[1:3] == (batch, prompt_bucket) and k[3] >= need
    )
    cache_bucket = compiled[0] if compiled else _cache_size(state, ladder, need)
    return ShapePlan(batch, prompt_len, prompt_bucket, cache_bucket)


def ladder_figures(model, prompt_lens: Iterable[int], max_new_tokens: int, batch: int = 1) -> dict:
    """What the model's ladder costs for calls with these prompt lengths, measured through :func:`plan_shapes`.

    Returns ``{"padding": fraction of prefill tokens that are padding, "unused_cache": fraction of static-cache
    slots no token ever occupies (the cache holds ``prompt + max_new_tokens - 1`` real tokens at most),
    "graphs": prefill graphs + decode graphs the calls need, "prompt_buckets", "cache_buckets"}``. Compiled
    shapes the model already has are preferred by :func:`plan_shapes`, as in a real call.

    Example:
        >>> ladder_figures(model, range(1, 2049), max_new_tokens=16)["padding"]     # doctest: +SKIP
        0.102...
    """
    padding = prefill = unused = slots = 0
    prefills, caches = set(), set()
    for n in prompt_lens:
        plan = plan_shapes(model, batch, int(n), max_new_tokens)
        padding += plan.prompt_bucket - plan.prompt_len
        prefill += plan.prompt_bucket
        unused += plan.cache_bucket - (plan.prompt_len + max_new_tokens - 1)
        slots += plan.cache_bucket
        prefills.add((plan.prompt_bucket, plan.cache_bucket))
        caches.add(plan.cache_bucket)
    return {
        "padding": padding / prefill if prefill else 0.0,
        "unused_cache": unused / slots if slots else 0.0,
        "graphs": len(prefills) + len(caches),
        "prompt_buckets": sorted({p for p, _ in prefills}),
        "cache_buckets": sorted(caches),
    }


def _input_vocab(model) -> int | None:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None:
        weight = getattr(embeddings, "weight", None)
        rows = None if weight is None else int(weight.shape[0])
    if rows is None:
        rows = getattr(model.config.get_text_config(decoder=True), "vocab_size", None)
    return rows


def fill_id(model, pad_token_id, eos_token_id=None) -> int:
    """An id ``model`` can embed, for positions the caller gave no token: ``pad_token_id`` when it is one, else the
    first end-of-sequence id that is, else 0.

    Example:
        >>> fill_id(model, -1, eos_token_id=2)          # doctest: +SKIP
        2
    """
    vocab = _input_vocab(model)

    def valid(token) -> bool:
        return token is not None and 0 <= int(token) and (vocab is None or int(token) < vocab)

    for token in (pad_token_id, *_ids(eos_token_id)):
        if valid(token):
            return int(token)
    return 0


def _ids(value) -> list:
    if value is None:
        return []
    if hasattr(value, "tolist"):
        value = value.tolist()
    return list(value) if isinstance(value, (list, tuple)) else [value]
