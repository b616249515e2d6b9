"""The token id the loops put where the caller gave none (a bucket's padding, a finished row's next input).

Upstream's ``generate`` writes the call's ``pad_token_id`` into the returned sequences only; it never embeds it where
a row is not finished. ``pad_token_id=-1`` (transformers' own tests pass it) or an id past the vocabulary is fine
there, but it cannot be embedded: the padding hf_tpu adds to reach a bucket, and a finished row's input to the
next decode step, take :func:`fill_id` instead (masked out, or never read back), and the sequences keep the
caller's pad id.
"""

from __future__ import annotations

__all__ = ["fill_id"]


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
