"""Device forms of upstream's sampling warpers: temperature, top-k, top-p, min-p, typical-p, epsilon and eta.

Each follows the upstream ``__call__`` of transformers 5.24 op for op, with the values that change between calls
(temperature, k, p, the cut-offs, ``min_tokens_to_keep``) read from the graph's scalar inputs. ``torch.topk`` with
a runtime ``k`` has no static shape: the k-th largest score is read from one full sort at rank ``k - 1`` instead, and
"keep the first ``m``" becomes a mask on the rank.
"""

from __future__ import annotations

from hf_tpu.transformers.sampling._registry import DeviceForm, Unsupported, register

__all__: list[str] = []


def _rank(scores):
    import torch

    return torch.arange(scores.shape[-1], device=scores.device)


def _kth_largest(scores, k):
    """The ``k``-th largest score of each row (``k``: a float tensor holding an integer >= 1)."""
    ordered = scores.sort(dim=-1, descending=True).values
    index = (k.long() - 1).reshape(1, 1).expand(scores.shape[0], 1)
    return ordered.gather(-1, index)


def _filter(proc) -> float:
    value = float(proc.filter_value)
    if value != float("-inf"):
        raise Unsupported(f"filter_value={value}")
    return value


# temperature -------------------------------------------------------------------------------------------------
def _temperature_apply(scores, s, t, static, ctx):
    return scores / s[0]


register(
    ["TemperatureLogitsWarper"],
    DeviceForm("temperature", lambda p, ctx: ([float(p.temperature)], ()), _temperature_apply),
)


# top-k --------------------------------------------------------------------------------------------------------
def _top_k_host(proc, ctx):
    _filter(proc)
    return [float(min(proc.top_k, ctx.vocab))], ()


def _top_k_apply(scores, s, t, static, ctx):
    return scores.masked_fill(scores < _kth_largest(scores, s[0]), float("-inf"))


register(["TopKLogitsWarper"], DeviceForm("top_k", _top_k_host, _top_k_apply))


# top-p --------------------------------------------------------------------------------------------------------
def _top_p_host(proc, ctx):
    _filter(proc)
    return [1.0 - float(proc.top_p), float(min(proc.min_tokens_to_keep, ctx.vocab))], ()


def _top_p_apply(scores, s, t, static, ctx):
    sorted_logits, sorted_indices = scores.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = (cumulative <= s[0]) & (_rank(scores) < scores.shape[-1] - s[1].long())
    remove = remove.scatter(1, sorted_indices, remove)
    return scores.masked_fill(remove, float("-inf"))


register(["TopPLogitsWarper"], DeviceForm("top_p", _top_p_host, _top_p_apply))


# min-p --------------------------------------------------------------------------------------------------------
def _min_p_host(proc, ctx):
    _filter(proc)
    return [float(proc.min_p), float(min(proc.min_tokens_to_keep, ctx.vocab))], ()


def _min_p_apply(scores, s, t, static, ctx):
    probs = scores.softmax(dim=-1)
    remove = probs < s[0] * probs.amax(dim=-1, keepdim=True)
    order = probs.sort(dim=-1, descending=True).indices
    keep = (_rank(scores) < s[1].long()).expand_as(remove)
    remove = remove & ~keep.scatter(1, order, keep)
    return scores.masked_fill(remove, float("-inf"))


register(["MinPLogitsWarper"], DeviceForm("min_p", _min_p_host, _min_p_apply))


# typical-p ----------------------------------------------------------------------------------------------------
def _typical_host(proc, ctx):
    _filter(proc)
    return [float(proc.mass), float(proc.min_tokens_to_keep)], ()


def _typical_apply(scores, s, t, static, ctx):
    import torch

    normalized = torch.nn.functional.log_softmax(scores, dim=-1)
    p = torch.exp(normalized)
    terms = normalized * p  # -inf * 0 is nan where a logit was masked out: those terms count as 0 (nansum is
    ent = -torch.where(terms.isnan(), 0.0, terms).sum(-1, keepdim=True)  # refused by torch-tpu 0.2.0)
    shifted = torch.abs((-normalized) - ent)
    sorted_scores, sorted_indices = torch.sort(shifted, descending=False)
    cumulative = scores.gather(-1, sorted_indices).softmax(dim=-1).cumsum(dim=-1)
    last_ind = (cumulative < s[0]).sum(dim=1).clamp(max=sorted_scores.shape[-1] - 1)
    remove = sorted_scores > sorted_scores.gather(1, last_ind.view(-1, 1))
    remove = remove & (_rank(scores) >= s[1].long())
    remove = remove.scatter(1, sorted_indices, remove)
    return scores.masked_fill(remove, float("-inf"))


register(["TypicalLogitsWarper"], DeviceForm("typical_p", _typical_host, _typical_apply))


# epsilon and eta ----------------------------------------------------------------------------------------------
def _epsilon_host(proc, ctx):
    _filter(proc)
    return [float(proc.epsilon), float(min(proc.min_tokens_to_keep, ctx.vocab))], ()


def _epsilon_apply(scores, s, t, static, ctx):
    remove = (scores.softmax(dim=-1) < s[0]) & (scores < _kth_largest(scores, s[1]))
    return scores.masked_fill(remove, float("-inf"))


register(["EpsilonLogitsWarper"], DeviceForm("epsilon", _epsilon_host, _epsilon_apply))


def _eta_apply(scores, s, t, static, ctx):
    import torch

    probabilities = scores.softmax(dim=-1)
    logits = (scores - scores.logsumexp(dim=-1, keepdim=True)).clamp(min=torch.finfo(scores.dtype).min)
    entropy = -(logits * logits.softmax(dim=-1)).sum(-1)
    epsilon = s[0]
    eta = torch.minimum(epsilon, torch.sqrt(epsilon) * torch.exp(-entropy))[..., None]
    remove = (probabilities < eta) & (scores < _kth_largest(scores, s[1]))
    return scores.masked_fill(remove, float("-inf"))


register(["EtaLogitsWarper"], DeviceForm("eta", _epsilon_host, _eta_apply))
