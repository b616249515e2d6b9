"""``output_attentions`` / ``output_hidden_states`` on hf_tpu's loops: every layer's attention weights and hidden
states of each forward, as upstream's loop returns them.

The graphs run the forward with the flags (a variant of each graph kind: ``"decode+attentions+hidden_states"``, the
features ``"attentions"`` and ``"hidden_states"`` of its :class:`~hf_tpu.transformers._graph_key.GraphKind`) and
return what it gives next to the next tokens; each forward's outputs are copied to the host whole (one copy per
step: slicing them on the device would be a new op shape, so a new eager program, at every step) and cut there to
the shapes upstream's loop returns. The bucket's padding is cut out: the rows of the prompt's padding, and the key
columns of the cache slots no token has reached (their weights are exactly zero: masked before the softmax), so
what remains is upstream's own tensors. Upstream's shapes, per forward of a decoder-only model:

* with a cache, the first forward ``(batch, heads, prompt, prompt)``, then ``(batch, heads, 1, prompt + i)``; with
  ``cache_implementation="static"`` the key axis is upstream's ``StaticCache`` length (``max_length - 1``): the
  same weights, zeros after them;
* without a cache (``use_cache=False``), ``(batch, heads, prompt + i, prompt + i)``;
* hidden states ``(batch, query, hidden)`` per layer and the embeddings, the queries as above.

Attentions come back only where the model's attention computes them (``attn_implementation="eager"``; upstream's
``sdpa`` gives none, and neither does this loop). They stay on the host, as the scores do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hf_tpu.transformers._graph_key import GraphKind

__all__: list[str] = []

FLAGS = ("output_attentions", "output_hidden_states")


def asked(generation_config) -> dict[str, bool]:
    """The output flags a call's generation config sets (``{}``: none; the graphs take them as model arguments)."""
    return {flag: True for flag in FLAGS if getattr(generation_config, flag, False)}


# The graph features of the flags (:class:`~hf_tpu.transformers._graph_key.GraphKind`'s ``"attentions"``, ...)
FEATURES = frozenset(flag.removeprefix("output_") for flag in FLAGS)


def features(flags: dict[str, bool]) -> tuple[str, ...]:
    """The graph features of a call asking for ``flags`` (``("attentions", "hidden_states")``)."""
    return tuple(flag.removeprefix("output_") for flag in FLAGS if flags.get(flag))


def is_variant(kind: GraphKind) -> bool:
    """Whether the graph kind ``kind`` returns attentions or hidden states."""
    return bool(kind.features & FEATURES)


def prepare(model) -> None:
    """Before the first trace of a graph returning outputs: install upstream's output-capturing hooks (transformers'
    ``capture_outputs`` installs them lazily, at the first forward asking for outputs, under a ``threading.Lock``
    that dynamo cannot trace). Done eagerly once, as upstream's first such forward would do it; the hooks then
    collect nothing unless a forward asks."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # pragma: no cover - a transformers without output capturing: nothing to install
        return
    maybe_install_capturing_hooks(model)


def with_outputs(result: tuple, out, extra: dict) -> tuple:
    """A graph's ``(tokens, logits)`` with ``(attentions, hidden_states)`` after them when ``extra`` asks for them
    (each None when not asked)."""
    if not any(extra.get(flag) for flag in FLAGS):
        return result
    attentions = out.attentions if extra.get("output_attentions") else None
    hidden = out.hidden_states if extra.get("output_hidden_states") else None
    return (*result, (attentions, hidden))


class StepOutputs:
    """The attentions and hidden states of a call's forwards, cut to upstream's shapes on the host.

    ``key_width``: pad each attention's key axis to this length (upstream's ``StaticCache`` length), else None."""

    def __init__(self, flags: dict[str, bool], key_width: int | None = None):
        self.attentions: tuple | None = () if flags.get("output_attentions") else None
        self.hidden_states: tuple | None = () if flags.get("output_hidden_states") else None
        self.key_width = key_width

    def add(self, outputs, rows: slice, keys: slice) -> None:
        """Keep one forward's ``outputs`` (the graph's ``(attentions, hidden_states)``, on the device): ``rows`` the
        queries upstream's forward had, ``keys`` the cache slots its keys held, in order."""
        attentions, hidden = outputs
        if self.attentions is not None:
            self.attentions += (tuple(self._keys(a.to("cpu")[:, :, rows, keys]) for a in attentions or ()),)
        if self.hidden_states is not None:
            self.hidden_states += (tuple(h.to("cpu")[:, rows] for h in hidden or ()),)

    def _keys(self, weights):
        import torch.nn.functional as F

        if self.key_width is None or weights.shape[-1] >= self.key_width:
            return weights
        return F.pad(weights, (0, self.key_width - weights.shape[-1]))

    def merge(self, count: int) -> None:
        """Make the last ``count`` forwards one, as upstream's single forward over those tokens (a continuation
        from a cache runs its uncached tokens one at a time): their queries in order, each row's keys padded with
        zeros to the last one's (the causal future, masked)."""
        import torch
        import torch.nn.functional as F

        if count <= 1:
            return
        if self.attentions is not None:
            steps, self.attentions = self.attentions[-count:], self.attentions[:-count]
            width = max((a.shape[-1] for step in steps for a in step), default=0)
            layers = zip(*steps)
            merged = tuple(torch.cat([F.pad(a, (0, width - a.shape[-1])) for a in layer], dim=2) for layer in layers)
            self.attentions += (merged,)
        if self.hidden_states is not None:
            steps, self.hidden_states = self.hidden_states[-count:], self.hidden_states[:-count]
            self.hidden_states += (tuple(torch.cat(layer, dim=1) for layer in zip(*steps)),)
