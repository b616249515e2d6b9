"""Qwen-Image 2.1's joint sequence layout, computed on the host once per pipeline call, so that the compiled
transformer is one graph per step.

diffusers 0.42's ``QwenImage21Transformer2DModel.forward`` derives the layout of its joint text/image sequence from
``img_mask`` (a boolean tensor on the device) on every call: ``repeat_interleave`` by a mask (an output shape that
depends on the data), a boolean scatter, ``tolist()`` for the rotary positions and the attention segments,
``nonzero`` and ``int(mask.sum())``. Each is a graph break, on a chip as on the CPU's ``aot_eager``, and on a TPU each
is a host round trip per step. The layout depends only on ``img_mask``'s values and ``img_shapes``, which are the same
for every step of one call.

With the ``diffusers`` integration enabled (``hf_tpu.enable()``), two patches (through :mod:`hf_tpu._patch`,
written for diffusers ``>=0.42,<0.43``, reverted by ``hf_tpu.disable()``) move that work to the host:

- ``QwenImage21Transformer2DModel.__call__`` (the module call, outside any compiled region) replaces the
  ``img_mask`` tensor with a :class:`JointLayout`: the mask is read to the host once, upstream's own helpers
  (``QwenImage21Rope``, ``build_token_metadata``, ``_qwenimage21_prefix_segments``) run on it there, and the
  results go to the device as index tensors. It is kept for the mask tensor it was made from: the pipeline passes
  the same ``image_pad_mask`` at every step, so one call reads it once.
- ``QwenImage21Transformer2DModel.forward`` with a :class:`JointLayout` builds the joint sequence by gathers with
  those indices (no scatter, no data-dependent shape) and runs upstream's blocks, norms and projections unchanged;
  with anything else (a tensor ``img_mask``, flex-attention processors) it is upstream's forward.

The values are upstream's exactly (the same rotary table, segments and masks; the joint sequence is a copy of the
same rows). What remains per step is one graph per step kind: the first step (the KV-cache prefill, ``"extract"``)
and the later ones (``"cached"``) are two graphs per size and prompt length.

A Modular Diffusers Qwen-Image 2.1 pipeline builds a new ``img_mask`` tensor at every step, so there the mask is read
to the host once per step (a small copy, not a graph break).

Example:
    >>> import hf_tpu
    >>> from hf_tpu.diffusers import compile_pipeline
    >>> hf_tpu.enable()                                  # doctest: +SKIP
    >>> pipe.to("tpu"); compile_pipeline(pipe)           # doctest: +SKIP  (one graph per step, no break)
"""

from __future__ import annotations

import copy
import functools
import weakref
from dataclasses import dataclass
from typing import Any

from hf_tpu._patch import original, patch
from hf_tpu.errors import InvalidArgumentError

__all__ = ["JointLayout", "apply", "joint_layout"]

FEATURE = "diffusers"
_WRITTEN_FOR = ">=0.42,<0.43"
_MODULE = "diffusers.models.transformers.transformer_qwenimage21"


@dataclass(frozen=True, eq=False)
class JointLayout:
    """The joint text/image sequence of one ``QwenImage21Transformer2DModel`` call, derived from ``img_mask`` and
    ``img_shapes`` on the host.

    Python values (graph constants): ``length`` (joint tokens), ``prefix_len`` (text and condition-image tokens before
    the target image), ``segments`` (upstream's ``(start, end, is_text)`` prefix runs). Tensors (graph inputs, on the
    model's device): ``source_index`` picks each joint token from ``cat([encoder_hidden_states, hidden_states])``,
    ``key_index`` picks each token's validity from ``cat([encoder_hidden_states_mask, True])``, ``rotary_emb`` is
    upstream's rotary table, ``target_token_mask`` marks the target image's tokens.
    """

    length: int
    prefix_len: int
    segments: tuple[tuple[int, int, bool], ...]
    source_index: Any
    key_index: Any
    rotary_emb: Any
    target_token_mask: Any


def joint_layout(model: Any, img_mask: Any, img_shapes: Any, text_len: int, device: Any) -> JointLayout:
    """Compute the :class:`JointLayout` of one call on the host (one read of ``img_mask[0]``), with upstream's own
    helpers, and put its tensors on ``device``.

    Example:
        >>> text_len = prompt_embeds.shape[1]  # doctest: +SKIP
        >>> layout = joint_layout(pipe.transformer, img_mask, img_shapes, text_len, "tpu")  # doctest: +SKIP
    """
    import torch

    module = __import__(_MODULE, fromlist=["_IMG_TOKENS_PER_SLOT"])
    shapes = [tuple(int(v) for v in s) for s in img_shapes[0]]
    mask = img_mask[0].to("cpu")
    repeats = torch.where(mask, module._IMG_TOKENS_PER_SLOT, 1)
    image_pad_mask = torch.repeat_interleave(mask, repeats)
    # Upstream: joint = repeat_interleave(cat([text, zeros]), repeats); joint[:, image_pad_mask] = hidden_states.
    # Here each joint token's row in cat([text, hidden_states]): its slot's text row, or its image token's row.
    source_index = torch.repeat_interleave(torch.arange(mask.numel()), repeats)
    image_positions = image_pad_mask.nonzero(as_tuple=True)[0]
    source_index[image_positions] = text_len + torch.arange(image_positions.numel())
    # Upstream: key_valid[:, text positions] = encoder_hidden_states_mask[:, text slots], True elsewhere.
    key_index = torch.full_like(source_index, text_len)
    text_positions = (~image_pad_mask).nonzero(as_tuple=True)[0]
    key_index[text_positions] = (~mask[:text_len]).nonzero(as_tuple=True)[0]
    # Upstream's rotary table and token metadata, computed on the host (a copy of the rope module, so the model's
    # own tables stay where they are).
    rotary_emb = copy.copy(model.pos_embed)(shapes, image_pad_mask, device=torch.device("cpu"))
    image_ids, target_token_mask = model.build_token_metadata(image_pad_mask, shapes)
    prefix_len = int((~target_token_mask).sum())
    segments = tuple(module._qwenimage21_prefix_segments(image_ids, prefix_len))
    return JointLayout(
        length=int(image_pad_mask.numel()),
        prefix_len=prefix_len,
        segments=segments,
        source_index=source_index.to(device),
        key_index=key_index.to(device),
        rotary_emb=rotary_emb.to(device),
        target_token_mask=target_token_mask.to(device),
    )


# The layout of each model's last img_mask tensor: (weak reference to the mask, key, layout).
_LAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cached_layout(model: Any, img_mask: Any, img_shapes: Any, text_len: int, device: Any) -> JointLayout:
    key = (repr(img_shapes[0]), text_len, str(device), tuple(img_mask.shape))
    last = _LAST.get(model)
    if last is not None and last[0]() is img_mask and last[1] == key:
        return last[2]
    layout = joint_layout(model, img_mask, img_shapes, text_len, device)
    _LAST[model] = (weakref.ref(img_mask), key, layout)
    return layout


def _static_layout_applies(model: Any, kwargs: dict) -> bool:
    import torch

    module = __import__(_MODULE, fromlist=["QwenImage21AttnProcessor"])
    if torch.compiler.is_compiling():  # called inside a caller's compiled region: reading the mask would break it
        return False
    if not isinstance(kwargs.get("img_mask"), torch.Tensor) or kwargs.get("img_shapes") is None:
        return False
    if not isinstance(kwargs.get("encoder_hidden_states"), torch.Tensor):
        return False
    # The flex processor needs the block mask upstream builds from the layout; it keeps upstream's path.
    return all(isinstance(b.attn.processor, module.QwenImage21AttnProcessor) for b in model.transformer_blocks)


def _call(upstream_call: Any) -> Any:
    @functools.wraps(upstream_call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and _static_layout_applies(self, kwargs):
            hidden = kwargs["encoder_hidden_states"]
            kwargs["img_mask"] = _cached_layout(
                self, kwargs["img_mask"], kwargs["img_shapes"], hidden.shape[1], hidden.device
            )
        return upstream_call(self, *args, **kwargs)

    return __call__


def _static_forward(
    self: Any,
    hidden_states: Any,
    encoder_hidden_states: Any,
    timestep: Any,
    img_shapes: Any,
    img_mask: JointLayout,
    encoder_hidden_states_mask: Any = None,
    attention_kwargs: Any = None,
    kv_cache: Any = None,
    kv_cache_mode: str | None = None,
    return_dict: bool = True,
) -> Any:
    """Upstream's forward from the joint sequence on, with the layout taken from ``img_mask`` (a JointLayout)."""
    import torch
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    layout = img_mask
    batch_size = hidden_states.shape[0]
    if kv_cache is not None and not self.config.causal_condition:
        raise InvalidArgumentError("kv_cache requires `causal_condition=True` (upstream's rule).")
    if kv_cache is not None and kv_cache_mode not in ("extract", "cached"):
        raise InvalidArgumentError(
            f"kv_cache_mode must be 'extract' or 'cached' when kv_cache is given, got {kv_cache_mode!r}."
        )
    if kv_cache is None and kv_cache_mode is not None:
        raise InvalidArgumentError(
            f"kv_cache_mode is {kv_cache_mode!r} but no kv_cache was passed to hold the prefix."
        )

    hidden_states = self.img_in(hidden_states)
    encoder_hidden_states = self.txt_in(encoder_hidden_states)
    joint_hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1).index_select(1, layout.source_index)
    rotary_emb = layout.rotary_emb
    target_token_mask = layout.target_token_mask

    timestep = timestep.to(hidden_states.dtype)
    modulation_mask = None
    if self.config.causal_condition:
        timestep = torch.cat([timestep, timestep.new_zeros(1)], dim=0)
        modulation_mask = target_token_mask
    temb = self.time_text_embed(timestep, hidden_states)
    modulation = self.modulation(temb)

    joint_key_valid = None
    if encoder_hidden_states_mask is not None:
        valid = encoder_hidden_states_mask.bool()
        valid = torch.cat([valid, valid.new_ones(batch_size, 1)], dim=1)
        joint_key_valid = valid.index_select(1, layout.key_index)

    prefix_len = layout.prefix_len
    if kv_cache_mode == "cached":
        joint_hidden_states = joint_hidden_states[:, prefix_len:]
        rotary_emb = rotary_emb[prefix_len:]
        modulation_mask = modulation_mask[prefix_len:]
        attention_mask = None if joint_key_valid is None else joint_key_valid[:, None, None, :]
        cache_write_slice = None
        block_segments, block_key_valid = None, None
    else:
        attention_mask = None
        block_segments = list(layout.segments)
        cache_write_slice = slice(0, prefix_len) if kv_cache_mode == "extract" else None
        block_key_valid = joint_key_valid

    for index_block, block in enumerate(self.transformer_blocks):
        layer_cache = kv_cache.get_layer(index_block) if kv_cache is not None else None
        block_args = (
            joint_hidden_states,
            modulation,
            rotary_emb,
            attention_mask,
            modulation_mask,
            layer_cache,
            kv_cache_mode,
            cache_write_slice,
            block_segments,
            block_key_valid,
        )
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            joint_hidden_states = self._gradient_checkpointing_func(block, *block_args)
        else:
            joint_hidden_states = block(*block_args)

    joint_hidden_states = self.norm_out(joint_hidden_states, temb, modulation_mask)
    output = self.proj_out(joint_hidden_states)
    if not return_dict:
        return (output,)
    return Transformer2DModelOutput(sample=output)


def _forward(upstream_forward: Any) -> Any:
    from diffusers.utils.peft_utils import apply_lora_scale

    static = apply_lora_scale("attention_kwargs")(_static_forward)

    @functools.wraps(upstream_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(kwargs.get("img_mask"), JointLayout):
            return static(self, *args, **kwargs)
        return upstream_forward(self, *args, **kwargs)

    return forward


def apply() -> None:
    """Patch ``QwenImage21Transformer2DModel.__call__`` and ``forward`` (idempotent; a diffusers without Qwen-Image
    2.1 is left alone)."""
    try:
        module = __import__(_MODULE, fromlist=["QwenImage21Transformer2DModel"])
    except ImportError:
        return
    cls = module.QwenImage21Transformer2DModel
    if not hasattr(module, "_qwenimage21_prefix_segments") or not hasattr(cls, "build_token_metadata"):
        return  # another layout than the one this was written for: upstream's forward, with its graph breaks
    for name, wrap in (("__call__", _call), ("forward", _forward)):
        if getattr(cls.__dict__.get(name), "__hf_tpu_layout__", False):
            continue  # already patched (idempotent)
        replacement = wrap(original(cls, name))
        replacement.__hf_tpu_layout__ = True  # type: ignore[attr-defined]
        patch(cls, name, replacement, feature=FEATURE, package="diffusers", versions=_WRITTEN_FOR)
