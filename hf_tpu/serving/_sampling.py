"""Per-request sampling inside one compiled continuous-batching step, and the step's log-probabilities.

transformers 5.24's continuous batching samples every request of a step alike (``do_sample`` of the manager's one
generation config, ``torch.multinomial`` on one generator); its per-request processors (``per_request_processors``)
cover temperature, top-k and top-p only when the manager's config already has them, cannot mix greedy and sampled
rows (a temperature of 0 divides by zero) and have no per-request seed. On a ``tpu`` model hf_tpu replaces the
manager's logits-processor list with :class:`RowSampling` and the step's processing and sampling with :func:`step`:

* each row of the step carries its own temperature (0: greedy), top-k, top-p, min-p and a noise key in the step's
  existing per-row argument tensor (``logits_processor_args``: :data:`ROWS` int32 rows, floats viewed as int32),
  filled on the host by :meth:`RowSampling.prepare_tensor_args` with the other inputs of the step; a new value is
  new data, never a new graph;
* sampling is the Gumbel-max trick: the argmax of the filtered, temperature-scaled logits plus Gumbel noise, which
  draws from exactly the softmax of those logits; the noise comes from a counter-based hash of the row's key and the
  token id (:func:`gumbel`), so a request's draws depend only on its seed, its choice index and the position of the
  token, not on which other requests share the step or on a device generator: a seed repeats an answer exactly;
* the filters are transformers' warpers' rules (temperature, then top-k, top-p and min-p on the softmax of what is
  left, the most likely token always kept), computed once on one sort of each row;
* the penalties and biases of each request (``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
  ``logit_bias``, ``min_tokens``; the model's generation config gives the defaults, its repetition penalty included)
  run before the filters, from a row per request kept on the device (:mod:`hf_tpu.serving._penalties`);
* the log-softmax of the raw logits is written with the token: the chosen token's log-probability and the
  :data:`hf_tpu.serving._runner.SETTINGS` ``max_logprobs`` most likely tokens with theirs, into extra rows of the
  step's output tensor; the host reads those rows only when a request of the step asked for log-probabilities
  (:func:`batch_update`), in the same one copy as the tokens.

Other logits processors of the model's generation config that upstream keeps run first, on every row alike.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_tpu.errors import HfTpuRuntimeError, InvalidArgumentError
from hf_tpu.serving import _grammar, _penalties, _staging
from hf_tpu.serving._openai import GREEDY_BELOW

__all__ = ["ROWS", "RowSampling", "batch_update", "gumbel", "logprob_records", "noise_key", "request_kwargs",
           "row_sampling_of", "sample", "step"]  # fmt: skip

#: The per-row arguments, one int32 row each: temperature (float), top-k, top-p (float), min-p (float), noise key,
#: the three penalties (floats), the request's row of :class:`~hf_tpu.serving._penalties.RequestTable`, 1 while
#: the request is under its ``min_tokens``, and 1 when its grammar masks the row (:mod:`hf_tpu.serving._grammar`).
ROWS = ("temperature", "top_k", "top_p", "min_p", "key", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "row", "block_eos", "grammar")  # fmt: skip
_FLOAT_ROWS = (0, 2, 3, 5, 6, 7)
_CHILD = "__child#"
_M64 = (1 << 64) - 1
# transformers' warpers that the rows carry (their values per request), and its per-request CB processors
_PER_ROW = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
            ContinuousBatchingLogitsProcessor)  # fmt: skip


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_FLOAT32_MAX = 3.4028234663852886e38


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _splitmix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def noise_key(seed: int, choice: int, position: int) -> int:
    """The 32-bit noise key (a signed int32) of the token at ``position`` of choice ``choice`` of a request seeded
    with ``seed``."""
    z = _splitmix(seed & _M64)
    z = _splitmix(z ^ (choice & 0xFFFFFFFF))
    z = _splitmix(z ^ (position & 0xFFFFFFFF))
    z &= 0xFFFFFFFF
    return z - (1 << 32) if z >= 1 << 31 else z


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 values (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (32 - bits)) - 1)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply, two rounds) of int32 values, wrapping on overflow."""
    x = x ^ _shr(x, 16)
    x = x * 0x7FEB352D
    x = x ^ _shr(x, 15)
    x = x * -0x7B935975  # 0x846CA68B as a signed int32
    return x ^ _shr(x, 16)


def gumbel(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise ``[rows, vocab]`` (float32) from each row's int32 key: a hash of the key and the token
    id, its top 24 bits a uniform in (0, 1)."""
    ids = _hash32(torch.arange(vocab, device=keys.device, dtype=torch.int32) * -0x61C8864F + 0x3C6EF372)
    bits = _shr(_hash32(keys.to(torch.int32)[:, None] ^ ids[None, :]), 8)
    uniform = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(uniform))


def filtered(scores: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """``scores`` (``[rows, vocab]``) divided by each row's temperature (rows at 0 or below: by 1), the tokens that
    top-k, top-p or min-p remove at ``-inf``: transformers' warpers, in their order."""
    vocab = scores.shape[-1]
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = scores / t[:, None]
    ordered, order = torch.sort(scaled, dim=-1, descending=True)
    rank = torch.arange(vocab, device=scores.device)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep = keep & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
    keep = keep & (probs >= min_p[:, None] * probs[:, :1])
    keep = keep | (rank == 0)  # the most likely token always stays (a top-p that is 0 in float32 keeps it alone)
    mask = torch.zeros_like(keep).scatter(1, order, keep)
    return scaled.masked_fill(~mask, float("-inf"))


def sample(scores: torch.Tensor, args: torch.Tensor) -> torch.Tensor:
    """The next token of each row of ``scores`` (``[rows, vocab]``) under its arguments (``args``: ``[ROWS, rows]``
    int32): greedy where the temperature is 0, else drawn from the filtered distribution."""
    rows, vocab = scores.shape
    args = args[:, :rows]
    temperature, top_p, min_p = (args[i].contiguous().view(torch.float32) for i in (0, 2, 3))
    top_k, keys = args[1], args[4]
    noisy = filtered(scores, temperature, top_k, top_p, min_p) + gumbel(keys, vocab)
    return torch.where(temperature[:, None] > 0, noisy, scores).argmax(dim=-1)


def penalized(scores: torch.Tensor, args: torch.Tensor, table) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores`` (``[rows, vocab]``) after each row's penalties and biases
    (:func:`hf_tpu.serving._penalties.penalize`), and each row's table row."""
    rows = scores.shape[0]
    args = args[:, :rows]
    repetition, presence, frequency = (args[i].contiguous().view(torch.float32) for i in (5, 6, 7))
    table_rows = args[8].long()
    return _penalties.penalize(scores, table, table_rows, repetition, presence, frequency, args[9]), table_rows


def step(runner, model, batch_data: dict, carry_over_ids, prev_output_ids, output_ids) -> None:
    """The continuous-batching step of a manager with :class:`RowSampling` (upstream's ``_forward_process_and_sample``
    with per-row sampling): forward, the model's other logits processors, per-row penalties and biases, per-row
    sampling (each token counted in its request's row), log-probabilities.
    ``output_ids`` rows: tokens, the chosen tokens' log-probabilities, then ``top_n`` token ids and ``top_n``
    log-probabilities (floats viewed as int32)."""
    sampler = runner.logit_processor
    staging = getattr(runner.inputs_and_outputs, "_hf_tpu_staging", None)
    if staging is not None:  # inputs staged on the host (hf_tpu.serving._staging): ids, indices and masks made here
        # in a copy of the dict: a value put into the caller's dict is a side effect dynamo returns from the graph (the
        # mask, the ids and both int64 indices were outputs of every step, through torch-tpu's real front end)
        batch_data = dict(batch_data)
        _staging.prepare_in_graph(staging, batch_data, prev_output_ids)
    runner.inputs_and_outputs.carry_over_tokens(batch_data["input_ids"], carry_over_ids, prev_output_ids)
    logits = model(**batch_data).logits
    indices = batch_data["logits_indices"]
    if "logits_to_keep" not in batch_data:
        logits = logits[:, indices, :]
    logits = logits[0].float()  # [rows, vocab]
    scores = logits
    if sampler.others:
        scores = sampler.others(batch_data["input_ids"][0, indices], logits)
    args = batch_data["logits_processor_args"]
    scores, table_rows = penalized(scores, args, sampler.table)
    if sampler.grammar is not None:  # each constrained row's grammar: the tokens it forbids at -inf
        ok = _grammar.allowed(sampler.grammar.masks, args[10, : scores.shape[0]], scores.shape[-1])
        scores = scores.masked_fill(~ok, float("-inf"))
    tokens = sample(scores, args)
    _penalties.record(sampler.table, table_rows, tokens)
    rows = tokens.shape[0]
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(1, tokens[:, None])[:, 0]
    output_ids[0, :rows].copy_(tokens.to(torch.int32))
    output_ids[1, :rows].copy_(chosen.contiguous().view(torch.int32))
    n = sampler.top_n
    if n:
        top = torch.topk(log_probs, n, dim=-1)
        output_ids[2 : 2 + n, :rows].copy_(top.indices.to(torch.int32).T)
        output_ids[2 + n : 2 + 2 * n, :rows].copy_(top.values.T.contiguous().view(torch.int32))


def _choice(request_id: str) -> int:
    """0 for a request, ``i + 1`` for its forked child ``i`` (upstream names it ``f"{id}__child#{i}"``)."""
    _, sep, index = request_id.rpartition(_CHILD)
    return int(index) + 1 if sep and index.isdigit() else 0


def row_sampling_of(manager) -> Any:
    """The manager's :class:`RowSampling`, or None (not a ``tpu`` model, or async batching)."""
    processor = getattr(manager, "logit_processor", None)
    return processor if isinstance(processor, RowSampling) else None


class RowSampling(ContinuousBatchingLogitsProcessorList):
    """The logits processing of a ``tpu`` continuous-batching manager: per-row sampling arguments (see the module
    docstring); ``others``: the model's other processors, run first on every row alike."""

    supported_kwargs = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "seed": int,
                        "logprobs": int, "repetition_penalty": float, "presence_penalty": float,
                        "frequency_penalty": float, "logit_bias": dict, "min_tokens": int, "grammar": str}  # fmt: skip

    def __init__(self, upstream, generation_config, top_n: int, table, grammar=None) -> None:
        kept = [p for p in upstream.logits_processor if not isinstance(p, _PER_ROW)]
        self.others = LogitsProcessorList(kept) if kept else None
        self.logits_processor = LogitsProcessorList(kept)
        self.top_n = int(top_n)
        self.table = table  # the per-request rows of the penalties (hf_tpu.serving._penalties.RequestTable)
        self.grammar = grammar  # the step's grammar masks (hf_tpu.serving._grammar.GrammarRows), or None
        self.output_rows = 2 + 2 * self.top_n
        self.tensors_required = len(ROWS)
        self.supported_keys = dict(self.supported_kwargs)
        self.ignored_keys = set()
        self.do_processing = True
        g = generation_config
        sampled = bool(getattr(g, "do_sample", False))
        if sampled and g.temperature is not None and g.temperature < GREEDY_BELOW:
            sampled = False  # as a request's temperature: greedy below vLLM's epsilon
        self.defaults = {
            "temperature": float(g.temperature if g.temperature is not None else 1.0) if sampled else 0.0,
            "top_k": int(g.top_k or 0) if sampled else 0,
            "top_p": float(g.top_p if g.top_p is not None else 1.0),
            "min_p": float(g.min_p or 0.0),
            # upstream's continuous batching drops these processors of the config: they run per row here
            "repetition_penalty": float(g.repetition_penalty if g.repetition_penalty is not None else 1.0),
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "min_tokens": int(g.min_new_tokens or 0),
        }
        self._base_seed: int | None = None

    def __repr__(self) -> str:
        return f"RowSampling(defaults={self.defaults}, top_n={self.top_n}, others={self.others})"

    def clear(self) -> None:
        super().clear()
        self.others, self.tensors_required = None, len(ROWS)
        self.supported_keys, self.do_processing = dict(self.supported_kwargs), True

    def _padding(self) -> tuple:
        """The arguments of a padding row: the defaults, no penalty, the table's spare row."""
        d = self.defaults
        return (d["temperature"], d["top_k"], d["top_p"], d["min_p"], 0, 1.0, 0.0, 0.0, self.table.spare, 0, 0)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.copy_(self._columns([self._padding()]).to(int32_tensor.device))

    @staticmethod
    def _columns(rows: list[tuple]) -> torch.Tensor:
        """``[len(ROWS), len(rows)]`` int32 from per-row tuples in :data:`ROWS` order (floats viewed as int32)."""
        columns = list(zip(*rows))
        out = torch.tensor([columns[i] if i not in _FLOAT_ROWS else [0] * len(rows) for i in range(len(ROWS))],
                           dtype=torch.int32)  # fmt: skip
        floats = torch.tensor([columns[i] for i in _FLOAT_ROWS], dtype=torch.float32).view(torch.int32)
        out[list(_FLOAT_ROWS)] = floats
        return out

    def _seed(self, state) -> int:
        seed = state.logit_processor_kwargs.get("seed")
        if seed is not None:
            return seed
        if self._base_seed is None:  # after the manager seeded torch (the same on every tensor-parallel rank)
            self._base_seed = torch.initial_seed()
        return self._base_seed ^ zlib.crc32(state.request_id.rpartition(_CHILD)[0].encode() or
                                             state.request_id.encode())  # fmt: skip

    def prepare_tensor_args(self, requests_in_batch, arg_storage: torch.Tensor) -> torch.Tensor:
        d = self.defaults
        rows, constrained = [], []
        for future in requests_in_batch:
            if not future.has_new_token:
                continue
            state = future.state
            kw = state.logit_processor_kwargs
            key = noise_key(self._seed(state), _choice(state.request_id), state.position_offset)
            repetition, presence, frequency, block_eos = _penalties.host_values(state, d)
            grammar = kw.get("grammar")
            if grammar is not None:
                generated = _penalties._tokens_of(state)[1]
                constrained.append((len(rows), state.request_id, grammar, generated))
            rows.append((float(kw.get("temperature", d["temperature"])), int(kw.get("top_k", d["top_k"])),
                         float(kw.get("top_p", d["top_p"])), float(kw.get("min_p", d["min_p"])), key,
                         repetition, presence, frequency, self.table.row_of(state), block_eos,
                         int(grammar is not None)))  # fmt: skip
        if self.grammar is not None:  # each constrained row's bitmask, on the device before the step runs
            self.grammar.prepare(constrained, self.table.rows)
        # every column: the padding rows count their tokens into the spare row, never into a request's
        rows += [self._padding()] * (arg_storage.shape[1] - len(rows))
        arg_storage.copy_(self._columns(rows).to(arg_storage.device))  # one copy for every row and argument
        return arg_storage

    def check_kwargs(self, kwargs: dict) -> None:
        """Refuse a request whose settings the step cannot hold (upstream calls this as the request joins the batch
        and fails that request alone): each int32 row's value in int32, each float row's finite in float32, the
        seed an integer, ``logprobs`` within the step's top-n, ``logit_bias`` token ids in the vocabulary."""
        super().check_kwargs(kwargs)
        for name, value in kwargs.items():
            kind = self.supported_kwargs.get(name)
            if kind is float and not (_is_real(value) and -_FLOAT32_MAX <= value <= _FLOAT32_MAX):
                raise InvalidArgumentError(f"{name}={value!r} is not a finite float32")
            if kind is int and name != "seed" and not (_is_integer(value) and _INT32_MIN <= value <= _INT32_MAX):
                raise InvalidArgumentError(f"{name}={value!r} does not fit in int32")
        if not 0 <= int(kwargs.get("logprobs", 0)) <= self.top_n:
            raise InvalidArgumentError(f"logprobs={kwargs['logprobs']} past the step's {self.top_n} top tokens")
        grammar = kwargs.get("grammar")
        if grammar is not None and (not isinstance(grammar, str) or self.grammar is None):
            raise InvalidArgumentError("grammar: an llguidance grammar string, on a manager with grammar rows")
        vocab = self.table.vocab
        for token, bias in (kwargs.get("logit_bias") or {}).items():
            if not (_is_integer(token) and 0 <= token < vocab and _is_real(bias) and -1e30 < bias < 1e30):
                raise InvalidArgumentError(f"logit_bias {token!r}: {bias!r} is not a token id of the vocabulary "
                                           f"({vocab}) and a finite bias")  # fmt: skip

    def __call__(self, input_ids, scores, logits_processor_args):
        raise HfTpuRuntimeError("RowSampling runs inside hf_tpu.serving._sampling.step, not as a processor list")


def batch_update(io, upstream):
    """``ContinuousBatchingIOs.prepare_batch_update`` for a step of :func:`step`: the tokens, and for the requests
    that asked for log-probabilities (``logprobs`` kwarg: how many alternatives) a record ``(chosen log-probability,
    ((token id, log-probability), ...))`` per new token, None for the others; one device-to-host copy."""
    requests = io.requests_in_batch
    wanted = [f.state.logit_processor_kwargs.get("logprobs") if f.has_new_token else None for f in requests]
    if all(w is None for w in wanted):
        return upstream(io)
    n = io.num_request_in_batch
    table = io.output_ids[:, :n].tolist()
    return requests, table[0], logprob_records(table, [w for f, w in zip(requests, wanted) if f.has_new_token])


def logprob_records(table: list[list[int]], wanted: list) -> list:
    """The per-row records of :func:`batch_update` from a step's output rows read back (``table``: the rows of
    ``output_ids`` as lists, one column per row of the step), ``wanted``: per row, how many alternatives its request
    asked for, or None."""
    top = (len(table) - 2) // 2
    as_float = torch.tensor(table[1:2] + table[2 + top :], dtype=torch.int32).view(torch.float32).tolist()
    records = []
    for row, want in enumerate(wanted):
        if want is not None:
            k = min(int(want), top)
            alternatives = tuple((table[2 + j][row], as_float[1 + j][row]) for j in range(k))
            records.append((as_float[0][row], alternatives))
        else:
            records.append(None)
    return records


def request_kwargs(sampling) -> dict:
    """The ``add_request`` kwargs of a :class:`~hf_tpu.serving._openai.Sampling` (a random seed when it has none)."""
    import secrets

    kwargs: dict[str, Any] = {
        "temperature": float(sampling.temperature), "top_k": int(sampling.top_k), "top_p": float(sampling.top_p),
        "min_p": float(sampling.min_p),
        "seed": int(sampling.seed) if sampling.seed is not None else secrets.randbits(63),
        "repetition_penalty": float(sampling.repetition_penalty), "presence_penalty": float(sampling.presence_penalty),
        "frequency_penalty": float(sampling.frequency_penalty), "min_tokens": int(sampling.min_tokens),
    }  # fmt: skip
    if sampling.logit_bias:
        kwargs["logit_bias"] = dict(sampling.logit_bias)
    if sampling.scored:  # (best_of's ranking reads the chosen tokens' log-probabilities alone when not asked)
        kwargs["logprobs"] = int(sampling.top_logprobs)
    if sampling.grammar is not None:
        kwargs["grammar"] = sampling.grammar
    return kwargs
