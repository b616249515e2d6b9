"""Device forms of upstream's logits processors that generation configs set: repetition penalty,
``no_repeat_ngram_size``, ``bad_words_ids`` / ``sequence_bias``, ``suppress_tokens`` / ``begin_suppress_tokens``,
``min_length`` / ``min_new_tokens``, forced BOS/EOS, ``remove_invalid_values`` and ``renormalize_logits``.

Upstream's processors read ``input_ids`` (the whole sequence so far) on every step. On the device the graph keeps
what they need instead: the sequence length (``ctx.length``), the sequence itself where a processor matches
n-grams or prefixes (``ctx.history``: ``(batch, width)``, the prompt as the caller gave it, then the new tokens,
``-1`` in unused slots, which match no token), and the repetition penalty's set of tokens seen.
"""

from __future__ import annotations

from hf_tpu.errors import InvalidArgumentError
from hf_tpu.transformers.sampling._registry import DeviceForm, Unsupported, register

__all__: list[str] = []

_NEG_INF = float("-inf")


def _vocab_mask(ids, vocab: int):
    """A ``(vocab,)`` bool mask of ``ids`` (host); ids past the vocabulary are dropped as upstream's ``isin`` does."""
    import torch

    mask = torch.zeros(vocab, dtype=torch.bool)
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to("cpu")
    mask[ids[(ids >= 0) & (ids < vocab)]] = True
    return mask


# repetition penalty ----------------------------------------------------------------------------------------------
def _penalty_host(proc, ctx):
    """The tokens of the sequence so far as a ``(batch, vocab + 1)`` mask; ids past the vocabulary and the prompt
    positions the processor ignores (``prompt_ignore_length``) land in the extra column, as upstream drops them."""
    import torch

    ids = ctx.input_ids.clamp(max=ctx.vocab)
    ignore = proc.prompt_ignore_length
    if isinstance(ignore, int):
        if ignore > ids.shape[1]:  # would also ignore generated tokens
            raise Unsupported("prompt_ignore_length past the prompt")
        ids = ids[:, ignore:]
    elif isinstance(ignore, torch.Tensor):
        positions = torch.arange(ids.shape[1])
        ids = ids.masked_fill(positions[None, :] < ignore.to("cpu")[:, None], ctx.vocab)
    seen = torch.zeros(ids.shape[0], ctx.vocab + 1, dtype=torch.bool)
    seen.scatter_(1, ids, True)
    return [float(proc.penalty)], (seen,)


def _penalty_apply(scores, s, t, static, ctx):
    import torch

    (seen,) = t
    penalized = torch.where(scores < 0, scores * s[0], scores / s[0])
    return torch.where(seen[:, : scores.shape[-1]], penalized, scores)


def _penalty_advance(t, tokens):
    (seen,) = t
    seen.scatter_(1, tokens.clamp(max=seen.shape[1] - 1), True)


register(
    ["RepetitionPenaltyLogitsProcessor"],
    DeviceForm("repetition_penalty", _penalty_host, _penalty_apply, advance=_penalty_advance),
)


# no_repeat_ngram_size -----------------------------------------------------------------------------------------------
def _ngram_static(proc, ctx):
    return (int(proc.ngram_size),)


def _ngram_apply(scores, s, t, static, ctx):
    import torch

    (n,) = static
    history, ptr = ctx.history, ctx.ptr
    batch, vocab = scores.shape
    offsets = torch.arange(n - 1, device=history.device) - (n - 1)
    prefix = history.gather(1, (ptr + offsets).clamp(min=0).reshape(1, -1).expand(batch, n - 1))
    windows = history.unfold(dimension=1, size=n, step=1)
    ends = torch.arange(windows.shape[1], device=history.device) + (n - 1)
    matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1) & (ends < ptr) & (ctx.length >= n)
    last = windows[..., -1].clamp(min=0, max=vocab)
    banned = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=scores.device)
    banned = banned.scatter(1, torch.where(matches, last, vocab), True)
    return scores.masked_fill(banned[:, :vocab], _NEG_INF)


register(
    ["NoRepeatNGramLogitsProcessor"],
    DeviceForm(
        "no_repeat_ngram", lambda p, ctx: ([], ()), _ngram_apply, static=_ngram_static, needs_history=True
    ),
)


# sequence_bias and bad_words_ids -----------------------------------------------------------------------------------
def _bias_groups(proc) -> dict[int, list]:
    groups: dict[int, list] = {}
    for sequence, bias in proc.sequence_bias.items():
        if len(sequence) > 1:
            groups.setdefault(len(sequence) - 1, []).append((list(sequence), float(bias)))
    return groups


def _bias_static(proc, ctx):
    return tuple((length, len(group)) for length, group in sorted(_bias_groups(proc).items()))


def _bias_host(proc, ctx):
    """``(vocab,)`` single-token biases, then per prefix length: prefixes, last tokens, biases (upstream's
    ``_prepare_bias_variables``, with its check of ids past the vocabulary)."""
    import torch

    invalid = [t for seq in proc.sequence_bias for t in seq if t >= ctx.vocab]
    if invalid:
        raise InvalidArgumentError(
            f"The model vocabulary size is {ctx.vocab}, but the following tokens were being biased: {invalid}"
        )
    single = torch.zeros(ctx.vocab, dtype=torch.float32)
    for sequence, bias in proc.sequence_bias.items():
        if len(sequence) == 1:
            single[sequence[0]] = float(bias)
    tensors = [single]
    for _length, group in sorted(_bias_groups(proc).items()):
        tensors.append(torch.tensor([seq[:-1] for seq, _ in group], dtype=torch.long))
        tensors.append(torch.tensor([seq[-1] for seq, _ in group], dtype=torch.long))
        tensors.append(torch.tensor([bias for _, bias in group], dtype=torch.float32))
    return [], tuple(tensors)


def _bias_apply(scores, s, t, static, ctx):
    import torch

    history, ptr = ctx.history, ctx.ptr
    batch = scores.shape[0]
    bias = torch.zeros_like(scores) + t[0]
    for i, (length, _count) in enumerate(static):
        prefixes, last_tokens, biases = t[1 + 3 * i : 4 + 3 * i]
        index = (ptr + torch.arange(length, device=history.device) - length).clamp(min=0)
        suffix = history.gather(1, index.reshape(1, -1).expand(batch, length))
        matching = (suffix[:, None, :] == prefixes).all(dim=-1) & (ctx.length >= length)
        bias = bias.index_add(1, last_tokens, torch.where(matching, biases, 0.0))
    return scores + bias


register(
    ["SequenceBiasLogitsProcessor", "NoBadWordsLogitsProcessor"],
    DeviceForm("sequence_bias", _bias_host, _bias_apply, static=_bias_static, needs_history=True),
)


# suppress_tokens and begin_suppress_tokens -------------------------------------------------------------------------
def _suppress_apply(scores, s, t, static, ctx):
    return scores.masked_fill(t[0], _NEG_INF)


register(
    ["SuppressTokensLogitsProcessor"],
    DeviceForm("suppress_tokens", lambda p, ctx: ([], (_vocab_mask(p.suppress_tokens, ctx.vocab),)), _suppress_apply),
)


def _begin_suppress_apply(scores, s, t, static, ctx):
    return scores.masked_fill(t[0] & (ctx.length == s[0].long()), _NEG_INF)


register(
    ["SuppressTokensAtBeginLogitsProcessor"],
    DeviceForm(
        "begin_suppress_tokens",
        lambda p, ctx: ([float(p.begin_index)], (_vocab_mask(p.begin_suppress_tokens, ctx.vocab),)),
        _begin_suppress_apply,
    ),
)


# min_length and min_new_tokens -------------------------------------------------------------------------------------
def _min_length_apply(scores, s, t, static, ctx):
    return scores.masked_fill(t[0] & (ctx.length < s[0].long()), _NEG_INF)


register(
    ["MinLengthLogitsProcessor"],
    DeviceForm(
        "min_length",
        lambda p, ctx: ([float(p.min_length)], (_vocab_mask(p.eos_token_id, ctx.vocab),)),
        _min_length_apply,
    ),
)
register(
    ["MinNewTokensLengthLogitsProcessor"],
    DeviceForm(
        "min_new_tokens",
        lambda p, ctx: (
            [float(p.prompt_length_to_skip + p.min_new_tokens)],
            (_vocab_mask(p.eos_token_id, ctx.vocab),),
        ),
        _min_length_apply,
    ),
)


# forced BOS / EOS ------------------------------------------------------------------------------------------------
def _forced_apply(scores, s, t, static, ctx):
    import torch

    forced = torch.where(t[0], 0.0, _NEG_INF).to(scores.dtype).expand_as(scores)
    return torch.where(ctx.length == s[0].long(), forced, scores)


register(
    ["ForcedBOSTokenLogitsProcessor"],
    DeviceForm("forced_bos", lambda p, ctx: ([1.0], (_vocab_mask([p.bos_token_id], ctx.vocab),)), _forced_apply),
)
register(
    ["ForcedEOSTokenLogitsProcessor"],
    DeviceForm(
        "forced_eos",
        lambda p, ctx: ([float(p.max_length - 1)], (_vocab_mask(p.eos_token_id, ctx.vocab),)),
        _forced_apply,
    ),
)


# remove_invalid_values and renormalize_logits --------------------------------------------------------------------
def _inf_nan_apply(scores, s, t, static, ctx):
    import torch

    info = torch.finfo(scores.dtype)
    out = torch.where(scores != scores, 0.0, scores)
    out = torch.where(scores == float("inf"), info.max, out)
    return torch.where(scores == _NEG_INF, info.min, out)


register(["InfNanRemoveLogitsProcessor"], DeviceForm("remove_invalid_values", lambda p, ctx: ([], ()), _inf_nan_apply))
def _log_softmax_apply(scores, s, t, static, ctx):
    return scores.log_softmax(dim=-1)


register(["LogitNormalization"], DeviceForm("renormalize_logits", lambda p, ctx: ([], ()), _log_softmax_apply))
