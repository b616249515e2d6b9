"""Per-request penalties and biases inside the compiled continuous-batching step: ``repetition_penalty``,
``presence_penalty``, ``frequency_penalty``, ``logit_bias`` and ``min_tokens``, as vLLM honours them.

transformers 5.24's continuous batching drops the repetition penalty of the model's generation config
(``RepetitionPenaltyLogitsProcessor.supports_continuous_batching`` is False) and has no presence or frequency penalty,
logit bias or minimum length per request. Each of these needs what a request has seen, so hf_tpu keeps one row per
active request on the device (:class:`RequestTable`):

* ``tokens`` (int32, ``[rows + 1, vocab]``): bit 0 set for the prompt's tokens, bit 1 for the request's end-of-sequence
  ids, and 4 times the count of each generated token above them; filled on the host once, when the request's first
  token is chosen (its prompt, its EOS ids and, for a forked or restored request, what it generated before), then
  counted inside the step graph as each token is chosen (:func:`record`);
* ``bias`` (float32, ``[rows + 1, vocab]``): the request's ``logit_bias``, written once with its row.

The last row is a spare that the step's padding rows read and count into. Each row of a step carries its request's
row index and the penalty values in the step's per-row arguments (:data:`hf_tpu.serving._sampling.ROWS`), so any
mix of penalties in one step is the same graph. :func:`penalize` runs, on the float32 scores after the model's
other processors and before the warpers: the bias (and ``-inf`` on the EOS ids while fewer than ``min_tokens`` were
generated), then transformers' repetition penalty (``RepetitionPenaltyLogitsProcessor``: scores of tokens in the
prompt or generated divided by the penalty, multiplied where negative), then OpenAI's presence and frequency
penalties over the generated tokens (``score - frequency * count - presence * (count > 0)``).

A request holds its row while it is active or waiting (a preempted request keeps it); the scheduler admits a new
request only when rows are free for it and its choices (:func:`admit`), so a row is always there when asked.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_tpu.errors import HfTpuError

__all__ = ["RequestTable", "RequestTableFull", "admit", "penalize", "record", "vocab_of"]

_NEG_INF = float("-inf")


class RequestTableFull(HfTpuError, RuntimeError):
    """More active requests than the per-request table has rows (``hf_tpu.serving.configure(max_active=...)``)."""


def vocab_of(model) -> int:
    """The width of ``model``'s logits (its output embedding's rows, else the config's vocabulary)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None and weight.ndim == 2:
        return int(weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def _tokens_of(state) -> tuple[list[int], list[int]]:
    """A request's prompt and the tokens it generated so far (transformers' own split of a soft-reset request)."""
    if state._true_initial_tokens:
        cut = state._true_initial_tokens
        return state.initial_tokens[:cut], state.initial_tokens[cut:] + state.generated_tokens
    return state.initial_tokens, state.generated_tokens


def generated_count(state) -> int:
    return len(_tokens_of(state)[1])


class RequestTable:
    """Each active request's row on the device (see the module docstring): ``capacity`` rows and a spare."""

    def __init__(self, capacity: int, vocab: int, device) -> None:
        self.capacity, self.vocab = int(capacity), int(vocab)
        self.tokens = torch.zeros(self.capacity + 1, self.vocab, dtype=torch.int32, device=device)
        self.bias = torch.zeros(self.capacity + 1, self.vocab, dtype=torch.float32, device=device)
        self.rows: dict[str, int] = {}
        self.free = list(range(self.capacity - 1, -1, -1))

    @property
    def spare(self) -> int:
        """The row of the step's padding rows."""
        return self.capacity

    def row_of(self, state) -> int:
        """The row of ``state``'s request, filled on the host the first time it is asked for."""
        row = self.rows.get(state.request_id)
        if row is None:
            if not self.free:
                raise RequestTableFull(
                    f"hf_tpu: {self.capacity} requests are active, as many as the per-request sampling table holds; "
                    "raise hf_tpu.serving.configure(max_active=...) (each row costs 8 bytes per vocabulary entry)"
                )
            row = self.free.pop()
            self.rows[state.request_id] = row
            self._fill(row, state)
        return row

    def _fill(self, row: int, state) -> None:
        prompt, generated = _tokens_of(state)
        flags = torch.zeros(self.vocab, dtype=torch.int32)
        ids = torch.tensor(prompt, dtype=torch.long)
        flags[ids[(ids >= 0) & (ids < self.vocab)]] = 1
        eos = torch.tensor(sorted(state._eos_token_ids), dtype=torch.long)
        flags[eos[(eos >= 0) & (eos < self.vocab)]] |= 2
        done = torch.tensor(generated, dtype=torch.long)
        done = done[(done >= 0) & (done < self.vocab)]
        flags.index_add_(0, done, torch.full_like(done, 4, dtype=torch.int32))
        bias = torch.zeros(self.vocab, dtype=torch.float32)
        for token, value in (state.logit_processor_kwargs.get("logit_bias") or {}).items():
            bias[int(token)] += float(value)
        index = torch.tensor([row], dtype=torch.long).to(self.tokens.device)
        self.tokens.index_copy_(0, index, flags[None].to(self.tokens.device))  # one copy each, once per request
        self.bias.index_copy_(0, index, bias[None].to(self.bias.device))

    def release(self, live) -> None:
        """Free the rows of requests no longer in ``live`` (the ids of the active and waiting requests)."""
        for request_id in [r for r in self.rows if r not in live]:
            self.free.append(self.rows.pop(request_id))


def admit(scheduler, candidates: list, table: RequestTable) -> list:
    """The waiting ``candidates`` the scheduler may admit now: those (and their choices) for which ``table`` has
    rows, after freeing the rows of requests that left; at least one when nothing is active (it then fails with
    :class:`RequestTableFull` if it alone needs more rows than the table has)."""
    live = set(scheduler.active_requests) | set(scheduler.waiting_requests)
    table.release(live)
    used = sum(1 + int(getattr(s, "num_children", 0) or 0) for s in scheduler.active_requests.values())
    budget = table.capacity - used
    admitted = []
    for state in candidates:
        need = 0 if state.request_id in table.rows else 1 + int(getattr(state, "num_children", 0) or 0)
        if need > budget and (admitted or scheduler.active_requests):
            break
        budget -= need
        admitted.append(state)
    return admitted


def penalize(scores, table: RequestTable, rows, repetition, presence, frequency, block_eos):
    """In the graph: ``scores`` (float32 ``[n, vocab]``) after each row's bias, ``min_tokens``, repetition, presence
    and frequency penalties (``rows``: each row's table row; the others: per-row values, ``block_eos`` nonzero while
    the request is under its ``min_tokens``)."""
    seen = table.tokens.index_select(0, rows)
    scores = scores + table.bias.index_select(0, rows)
    scores = scores.masked_fill(((seen & 2) != 0) & (block_eos[:, None] != 0), _NEG_INF)
    penalty = repetition[:, None]
    repeated = ((seen & 1) != 0) | (seen >= 4)
    scores = torch.where(repeated, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
    count = (seen >> 2).to(scores.dtype)
    return scores - frequency[:, None] * count - presence[:, None] * (count > 0).to(scores.dtype)


def record(table: RequestTable, rows, tokens) -> None:
    """In the graph: count each row's chosen token in its request's row."""
    table.tokens.index_put_((rows, tokens), torch.full_like(tokens, 4, dtype=torch.int32), accumulate=True)


def host_values(state, defaults: dict[str, Any]) -> tuple[float, float, float, int]:
    """A request's ``(repetition, presence, frequency, block_eos)`` for the step about to choose its next token."""
    kw = state.logit_processor_kwargs
    repetition = float(kw.get("repetition_penalty", defaults["repetition_penalty"]))
    presence = float(kw.get("presence_penalty", defaults["presence_penalty"]))
    frequency = float(kw.get("frequency_penalty", defaults["frequency_penalty"]))
    min_tokens = int(kw.get("min_tokens", defaults["min_tokens"]))
    return repetition, presence, frequency, int(generated_count(state) < min_tokens)
