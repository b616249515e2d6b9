"""The prompt's log-probabilities of a ``/v1/completions`` request with ``echo`` and ``logprobs`` (OpenAI's legacy
completions format, what lm-evaluation-harness's ``local-completions`` scores a continuation with).

One eager forward of the served model over the prompt on its device (the ``tpu`` device; no KV cache, not the
continuous batch's compiled step graphs, whose prefill keeps the last position's logits only), run off the event loop
in a worker thread, one prompt at a time (:data:`_LOCK`: a prompt's float32 logits, tokens x vocabulary, are the
largest thing it holds). The log-softmax of every position's logits and the top-``n`` are taken on the device; only
the chosen tokens' values and the top-``n`` (values and ids) are read back. The values are the raw model
distribution, as the generated tokens' logprobs (:mod:`hf_tpu.serving._sampling`): before temperature, penalties
and filters.
"""

from __future__ import annotations

import threading

__all__ = ["prompt_logprobs"]

_LOCK = threading.Lock()


def prompt_logprobs(model, ids: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Per token of ``ids``: None for the first (nothing precedes it), then ``(its log-probability after the tokens
    before it, [(token id, log-probability)] of the ``top`` most likely tokens there, most likely first)``.

    Args:
        model: the causal LM (on its device).
        ids: the prompt's token ids (at least one).
        top: how many most likely tokens per position (0: none).
    """
    import torch

    if len(ids) < 2:
        return [None] * len(ids)
    with _LOCK, torch.no_grad():
        inputs = torch.tensor([ids], dtype=torch.long, device=model.device)
        logits = model(input_ids=inputs, use_cache=False).logits[0, :-1].float()
        log_probs = torch.log_softmax(logits, dim=-1)
        chosen = log_probs.gather(-1, inputs[0, 1:, None])[:, 0].cpu().tolist()
        if top:
            values, indices = log_probs.topk(top, dim=-1)
            values, indices = values.cpu().tolist(), indices.cpu().tolist()
        else:
            values = indices = [[] for _ in chosen]
    return [None] + [(c, list(zip(i, v))) for c, i, v in zip(chosen, indices, values)]
