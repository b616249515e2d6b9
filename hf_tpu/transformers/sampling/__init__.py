"""Logits processors, warpers and sampling inside the compiled decode graph.

Upstream's ``generate`` builds a ``LogitsProcessorList`` from the generation config (repetition penalty, n-gram
bans, bad words, min length, ..., then temperature, top-k, top-p, ... when sampling). :func:`device_plan` maps each
processor, by class, to its device form (:mod:`~hf_tpu.transformers.sampling._registry`) and packs what the forms
need into a few tensors sent once per call with the prefill; :func:`select` then runs the forms in upstream's order
on the last logits row inside the graph and picks the next tokens: ``argmax`` for greedy search, and for sampling an
exponential race (``argmax(p / E)``, ``E ~ Exp(1)`` drawn from the device generator in the graph), which draws
token ``i`` with probability ``p_i`` exactly as ``torch.multinomial`` does. Each decode step still sends one
``(batch, 2)`` tensor and reads back one ``(batch,)`` tensor of tokens.

The graph depends on which processors run (and on a few shapes: the n-gram size, the bad-word lengths), never on
their values: temperature, k, p and the cut-offs are graph inputs, so a call with other values compiles nothing.
A processor without a device form (a user's own, say) keeps the host path (see :func:`host_path_cost`).

Example:
    >>> from hf_tpu.transformers.sampling import device_plan                 # doctest: +SKIP
    >>> plan = device_plan(processors, input_ids, vocab=151936, do_sample=True)   # doctest: +SKIP
    >>> str(plan.variant)                                                      # doctest: +SKIP
    '+temperature+top_k+top_p+sample'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The built-in device forms register themselves in the registry (processors first, then warpers).
from hf_tpu.transformers._graph_key import Variant
from hf_tpu.transformers.sampling import _processors, _warpers  # noqa: F401
from hf_tpu.transformers.sampling._registry import DeviceForm, Unsupported, form_for, forms, register

__all__ = [
    "DeviceForm",
    "DevicePlan",
    "Unsupported",
    "advance",
    "device_plan",
    "host_path_cost",
    "process",
    "register",
    "select",
]


@dataclass
class _HostContext:
    input_ids: Any  # (batch, prompt_len) on the host, as upstream's processors see it at the first step
    vocab: int


@dataclass
class DevicePlan:
    """What one call runs on the device: ``variant`` (the graph kinds' sampling program, a
    :class:`~hf_tpu.transformers._graph_key.Variant`: ``str()`` gives ``"+top_k+sample"``), and the host values
    :meth:`to_device` sends once per call."""

    variant: Variant
    program: tuple = ()
    do_sample: bool = False
    scalars: tuple = ()
    tensors: tuple = ()
    needs_history: bool = False
    input_ids: Any = None

    def to_device(self, device, history_width: int, history_offset: int) -> tuple | None:
        """The graph argument ``((program, do_sample), state, scalars, history, tensors)`` on ``device`` (None for
        plain greedy search). ``history_width``/``history_offset``: the device history's width and the slot of
        the prompt's first token (after the prompt bucket's left padding)."""
        import torch

        if not self.variant:
            return None
        batch, prompt_len = self.input_ids.shape
        state = torch.tensor([prompt_len, history_offset + prompt_len], dtype=torch.long).to(device)
        params = torch.tensor(self.scalars, dtype=torch.float32).to(device) if self.scalars else None
        history = None
        if self.needs_history:
            history = torch.full((batch, history_width), -1, dtype=torch.long)
            history[:, history_offset : history_offset + prompt_len] = self.input_ids
            history = history.to(device)
        tensors = tuple(t.to(device) for t in self.tensors)
        return ((self.program, self.do_sample), state, params, history, tensors)


class _GraphContext:
    """What the forms read in the graph: the sequence length, the history and the next history slot."""

    def __init__(self, state, history):
        self.length = state[0:1]
        self.ptr = state[1:2]
        self.history = history


def _label(name: str, static: tuple) -> str:
    if not static:
        return name
    parts = ["x".join(str(v) for v in s) if isinstance(s, tuple) else str(s) for s in static]
    return f"{name}({','.join(parts)})"


def device_plan(logits_processor, input_ids, *, vocab: int, do_sample: bool) -> DevicePlan | str:
    """The device plan of one call (``input_ids``: the prompt as upstream's processors see it), or a string saying
    why it keeps the host path (a processor without a device form)."""
    procs = list(logits_processor or [])
    input_ids = input_ids.to("cpu")
    if not procs and not do_sample:
        return DevicePlan(Variant(), input_ids=input_ids)
    if do_sample:
        procs = _with_identity_warpers(procs, int(vocab))
    ctx = _HostContext(input_ids, int(vocab))
    program, scalars, tensors, labels = [], [], [], []
    needs_history = False
    for proc in procs:
        form = form_for(proc)
        if form is None:
            return f"{type(proc).__name__} has no device form"
        try:
            values, extra = form.host(proc, ctx)
            static = tuple(form.static(proc, ctx))
        except Unsupported as exc:
            return f"{type(proc).__name__} with {exc} has no device form"
        program.append((form.name, static, len(scalars), len(values), len(tensors), len(extra)))
        scalars += [float(v) for v in values]
        tensors += list(extra)
        labels.append(_label(form.name, static))
        needs_history = needs_history or form.needs_history
    if do_sample:
        labels.append("sample")
    return DevicePlan(
        Variant(tuple(labels)), tuple(program), bool(do_sample), tuple(scalars), tuple(tensors), needs_history,
        input_ids,
    )


def process(logits, sampling):
    """In the graph: the float32 last logits row ``(batch, vocab)`` after the plan's processors, in upstream's order
    (what upstream's ``logits_processor(input_ids, logits)`` returns)."""
    (program, _), state, params, history, tensors = sampling
    ctx = _GraphContext(state, history)
    registry = forms()
    scores = logits
    for name, static, s0, ns, t0, nt in program:
        scalars = params[s0 : s0 + ns] if ns else None
        scores = registry[name].apply(scores, scalars, tensors[t0 : t0 + nt], static, ctx)
    return scores


def _with_identity_warpers(procs: list, vocab: int) -> list:
    """``procs`` with temperature 1, top-k = vocab and top-p = 1 added where upstream left them out, so that every
    chat model's sampling defaults (Qwen3's temperature/top-k/top-p, Gemma 3's top-k/top-p, ...) and every change of
    their values run one graph. Each added warper changes no probability; they go where upstream puts the three
    (one contiguous run, in this order), or last when none is there."""
    from transformers.generation import logits_process as lp

    kinds = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper)
    at = [i for i, p in enumerate(procs) if type(p) in kinds]
    present = [type(procs[i]) for i in at]
    if at and (at != list(range(at[0], at[0] + len(at))) or present != [k for k in kinds if k in present]):
        return procs  # not upstream's layout: run the list as it is
    start = at[0] if at else len(procs)
    have = {type(procs[i]): procs[i] for i in at}
    identity = {
        lp.TemperatureLogitsWarper: lambda: lp.TemperatureLogitsWarper(1.0),
        lp.TopKLogitsWarper: lambda: lp.TopKLogitsWarper(max(vocab, 1)),
        lp.TopPLogitsWarper: lambda: lp.TopPLogitsWarper(1.0),
    }
    run = [have[k] if k in have else identity[k]() for k in kinds]
    return procs[:start] + run + procs[start + len(at) :]


def select(logits, sampling):
    """In the graph: the next tokens from the float32 last logits row ``(batch, vocab)``."""
    import torch

    scores = process(logits, sampling)
    if not sampling[0][1]:
        return scores.argmax(dim=-1)
    probs = scores.softmax(dim=-1)
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) is token i with probability p_i (torch.multinomial's
    # law), from one uniform draw per token of the device generator; no multinomial kernel needed.
    race = -torch.log1p(-torch.rand_like(probs))
    return (probs / race.clamp_min(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)


def advance(sampling, tokens) -> None:
    """In the graph, before the model runs on ``tokens`` (``(batch, 1)``, just appended to the sequence): update the
    length, the history and the forms' own state, in place."""
    if sampling is None:
        return
    (program, _), state, _, history, tensors = sampling
    if history is not None:
        history.scatter_(1, state[1:2].reshape(1, 1).expand(tokens.shape[0], 1), tokens)
    state.add_(1)
    registry = forms()
    for name, _static, _s0, _ns, t0, nt in program:
        form = registry[name]
        if form.advance is not None:
            form.advance(tensors[t0 : t0 + nt], tokens)


def host_path_cost(batch: int, vocab: int) -> str:
    """What the host path costs per decode step, in words (for the one-time warning)."""
    per_step = batch * vocab * 4
    return (
        f"each decode step copies the last logits row to the host ({batch} x {vocab} float32 = "
        f"{per_step / 1024:.0f} KiB, against {batch * 8} bytes of tokens on the device path) and runs the processors "
        "and the sampler on the CPU"
    )
