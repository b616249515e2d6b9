"""Which path an encoder call takes: the bucketed, compiled forward or upstream's eager one, and why.

:func:`decide` is the one place that answers; :class:`EncoderRoute` is the one value that records the answer, read
by the forward (:mod:`hf_tpu.encoders.forward`) and by :func:`hf_tpu.encoders.explain`. The bucketed path pads
``input_ids``/``attention_mask``/``token_type_ids`` of shape ``(batch, length)`` to a bucket and slices the outputs
back; whatever it could not undo exactly goes to upstream's forward, with the reason named once
(:func:`hf_tpu._shared.notes.warn_once`, as generate's fallbacks do).

Example:
    >>> from hf_tpu.encoders.route import EncoderRoute
    >>> EncoderRoute(False, "labels given: ...").bucketed
    False
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

from hf_tpu.encoders._state import state as _state
from hf_tpu._shared.buckets import BucketOverflowError

__all__ = ["INPUTS", "EncoderRoute", "decide", "input_names"]

# The inputs the bucketed path pads (in this order in the packed device tensor).
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# Keyword arguments it accepts besides them (output_attentions only when not True); any other that is not None (or
# False) takes the eager path.
_FLAGS = ("output_hidden_states", "return_dict", "output_attentions")
# Attention implementations whose padding mask makes padded keys inert (checked: sdpa and eager).
_ATTENTION = ("sdpa", "eager")

# Arguments only a decoder's call passes (the encoder class as a causal LM's trunk, under generate).
_DECODER_USE = ("past_key_values", "cache", "cache_position", "encoder_hidden_states", "use_cache")

_WHY = {
    "labels": "labels given: the loss over a padded batch would differ from upstream's; compute the loss from the "
    "logits, or call without labels",
    "inputs_embeds": "inputs_embeds given instead of input_ids: the bucketed path pads token ids only",
    "position_ids": "position_ids given: the bucketed path lets the model number its positions itself",
    "head_mask": "head_mask given: the bucketed path runs the model with all heads",
}


@dataclass(frozen=True)
class EncoderRoute:
    """The path of one encoder call: ``bucketed`` (padded to ``batch_bucket`` x ``length_bucket``, compiled once
    per bucket) or not, with the ``reason`` when not; ``inputs`` are the call's arguments by name. ``quiet``: the
    reason is logged, not warned: the path was turned off for the model (``configure(model, bucketed=False)``), or
    the call is a decoder's (a decoder config, a cache or cross-attention states given: the encoder class as the
    trunk of a causal LM under ``generate``, whose route the generation loop names).

    Attributes:
        bucketed: whether the call runs padded to buckets, one compiled graph per bucket.
        reason: why not, when not bucketed; None otherwise.
        quiet: the reason is logged, not warned (see above).
        rows: the call's batch size.
        length: the call's sequence length.
        batch_bucket: the batch size it is padded to (0 when not bucketed).
        length_bucket: the length it is padded to (0 when not bucketed).
        hidden_states: whether the call asks for every layer's hidden states.
        return_dict: whether the call returns a ``ModelOutput`` (else a tuple).
        inputs: the call's arguments by name.
    """

    bucketed: bool
    reason: str | None = None
    quiet: bool = False
    rows: int = 0
    length: int = 0
    batch_bucket: int = 0
    length_bucket: int = 0
    hidden_states: bool = False
    return_dict: bool = True
    inputs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@functools.cache
def input_names(upstream) -> tuple[str, ...]:
    """The padded inputs a forward takes: ``input_ids`` and ``attention_mask``, and ``token_type_ids`` where the
    forward names it (then it is always passed, zeros when the call has none: what such models use by default)."""
    params = inspect.signature(upstream).parameters
    return tuple(n for n in INPUTS if n != "token_type_ids" or n in params)


def _flag(value: Any, default: Any) -> Any:
    return default if value is None else value


def decide(model, upstream, arguments: dict[str, Any]) -> EncoderRoute:
    """The route of ``upstream(model, **arguments)`` (``upstream``: the class's own forward; ``arguments``: the
    call's, bound by name)."""
    import torch

    config = model.config
    name = type(model).__name__

    def eager(reason: str) -> EncoderRoute:
        return EncoderRoute(False, f"{name}: {reason}", inputs=arguments)

    for key in _DECODER_USE:
        if arguments.get(key) is not None and arguments.get(key) is not False:
            reason = f"{name}: {key}= given: a decoder's call (generate's), not an encoder's"
            return EncoderRoute(False, reason, quiet=True, inputs=arguments)
    found = _state(model)
    if not found.bucketed:
        reason = f"{name}: turned off for this model (hf_tpu.encoders.configure(model, bucketed=False))"
        return EncoderRoute(False, reason, quiet=True, inputs=arguments)
    if found.problem is not None:
        return EncoderRoute(False, found.problem, inputs=arguments)
    if model.training:
        return eager(
            "the model is in training mode (dropout draws differ per shape): call model.eval() for inference; "
            "training batches get fixed shapes from hf_tpu.training.BucketingCollator"
        )
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        reason = f"{name}: config.is_decoder/add_cross_attention: a decoder (generate's), not an encoder"
        return EncoderRoute(False, reason, quiet=True, inputs=arguments)
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in _ATTENTION:
        return eager(
            f"attn_implementation={attention!r}: the bucketed path is checked with {' and '.join(_ATTENTION)}"
        )
    for key, value in arguments.items():
        if key in INPUTS or value is None or value is False or key in _FLAGS[:2]:
            continue
        if key == "output_attentions":
            return eager("output_attentions=True: attention maps of a padded batch are not sliced back")
        return eager(_WHY.get(key, f"{key}= given: the bucketed path pads only {', '.join(INPUTS)}"))
    selected = arguments.get("output_hidden_states")
    if selected is not None and not isinstance(selected, bool):
        return eager(f"output_hidden_states={selected!r} (chosen layers): the bucketed path returns all or none")
    if _flag(arguments.get("output_attentions"), getattr(config, "output_attentions", False)):
        return eager("config.output_attentions: attention maps of a padded batch are not sliced back")
    ids = arguments.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        return eager("no input_ids tensor")
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex:
        return eager(
            f"input_ids of shape {tuple(ids.shape)} and dtype {ids.dtype}: only integer (batch, length) inputs are "
            "bucketed (multiple-choice heads take the eager path)"
        )
    for key in INPUTS[1:]:
        value = arguments.get(key)
        if value is not None and (not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(ids.shape)):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            return eager(f"{key} of shape {shape}, not input_ids' {tuple(ids.shape)}: only 2-D masks are padded")
    rows, length = ids.shape
    if rows == 0 or length == 0:
        return eager("an empty batch")
    if rows > found.batch_sizes.max:
        return eager(
            f"a batch of {rows} rows, past the largest batch bucket ({found.batch_sizes.max}): upstream runs it; "
            "hf_tpu.encoders.configure(model, batch_sizes=[...]) adds buckets, or pass smaller batches"
        )
    try:
        length_bucket = found.length_ladder(config).bucket(
            length, "the input", "upstream runs it; hf_tpu.encoders.configure(model, lengths=[...]) adds buckets"
        )
    except BucketOverflowError as exc:
        return eager(str(exc))
    batch_bucket = found.batch_sizes.bucket(rows)
    hidden_states = bool(_flag(arguments.get("output_hidden_states"), getattr(config, "output_hidden_states", False)))
    if found.warmed:
        batch_bucket, length_bucket = _warmed_bucket(
            found.compiled,
            (batch_bucket, length_bucket, input_names(upstream), hidden_states, torch.is_grad_enabled()),
        )
    return EncoderRoute(
        True,
        rows=rows,
        length=length,
        batch_bucket=batch_bucket,
        length_bucket=length_bucket,
        hidden_states=hidden_states,
        return_dict=bool(_flag(arguments.get("return_dict"), getattr(config, "return_dict", True))),
        inputs=arguments,
    )


def _warmed_bucket(compiled: set[tuple], key: tuple) -> tuple[int, int]:
    """After warm-up: the ladder's bucket when its graph exists, else the smallest compiled graph (fewest padded
    slots) that holds the call (a short last batch pads to a warmed batch size rather than compiling its own), else
    the ladder's bucket (a compile; strict mode refuses it)."""
    rows, length, *rest = key
    if key in compiled:
        return rows, length
    holding = [k[:2] for k in compiled if k[0] >= rows and k[1] >= length and list(k[2:]) == rest]
    return min(holding, key=lambda k: (k[0] * k[1], k)) if holding else (rows, length)
