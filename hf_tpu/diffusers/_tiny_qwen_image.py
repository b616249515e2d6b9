"""A tiny Qwen-Image 2.1 pipeline built from configs (re-exported by :mod:`hf_tpu.diffusers.testing`).

Everything is local: a byte-level Qwen2 tokenizer with Qwen's chat and vision tokens, a Qwen3-VL text encoder, a
``QwenImage21Transformer2DModel`` and its VAE, all random and tiny (nothing is downloaded).

Example:
    >>> from hf_tpu.diffusers.testing import tiny_qwen_image_pipeline
    >>> pipe = tiny_qwen_image_pipeline()
    >>> pipe("a cat", height=32, width=32, num_inference_steps=2, output_type="np").images.shape
    (1, 32, 32, 4)
"""

from __future__ import annotations

import os
from typing import Any

from hf_tpu.errors import InvalidArgumentError

__all__ = ["qwen_tokenizer", "tiny_qwen_image_pipeline"]


_QWEN_SPECIAL_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
)  # fmt: skip
# The chat layout QwenImage21Pipeline formats by hand ("<|im_start|>role\ncontent<|im_end|>\n"); the pipeline counts
# the system tokens to drop by running this template on its system message, so the two must agree.
_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_tokenizer() -> Any:
    """A byte-level Qwen2 tokenizer with no merges (one token per byte, about 260 tokens), Qwen's chat and vision
    special tokens and a chat template."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab: dict[str, int] = {"<|endoftext|>": 0}
    from hf_tpu.diffusers._tiny_common import byte_chars

    for ch in byte_chars():
        vocab.setdefault(ch, len(vocab))
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=512)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in _QWEN_SPECIAL_TOKENS])
    tok.chat_template = _QWEN_CHAT_TEMPLATE
    return tok


def _qwen_vl_processor(tokenizer: Any) -> Any:
    """A ``Qwen3VLProcessor`` over ``tokenizer``: one vision token covers 32x32 pixels (a 2x2 group of the 16x
    latents). transformers' video processor needs torchvision; without it the processor is assembled with no video
    processor (text-to-image and image prompts never use it; it cannot be saved then)."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor

    images = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=64 * 64
    )
    try:
        import torchvision  # noqa: F401
    except ImportError:
        processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
        processor.chat_template = _QWEN_CHAT_TEMPLATE
        processor.tokenizer, processor.image_processor, processor.video_processor = tokenizer, images, None
        for attr, token in (
            ("image", "<|image_pad|>"),
            ("video", "<|video_pad|>"),
            ("vision_start", "<|vision_start|>"),
            ("vision_end", "<|vision_end|>"),
        ):
            setattr(processor, f"{attr}_token", token)
            setattr(processor, f"{attr}_token_id", tokenizer.convert_tokens_to_ids(token))
        return processor
    from transformers import Qwen3VLVideoProcessor

    video = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2)
    return Qwen3VLProcessor(images, tokenizer, video, chat_template=_QWEN_CHAT_TEMPLATE)


def tiny_qwen_image_pipeline(path: str | os.PathLike | None = None, *, seed: int = 0) -> Any:
    """A tiny :class:`diffusers.QwenImage21Pipeline` (Qwen-Image 2.1): a Qwen3-VL text encoder, a
    ``QwenImage21Transformer2DModel`` with a tensor-parallel plan (4 heads of 16: shards over 1, 2 or 4 ranks), the
    Qwen-Image 2.1 VAE (16x spatial compression) and a locally built tokenizer and processor.

    An image side must be a multiple of 32 (one vision slot stands for 2x2 latent tokens). ``path`` saves it with
    ``save_pretrained`` and returns the directory; that needs torchvision (the processor's video part).
    Returns the pipeline otherwise.
    """
    import torch
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tok = qwen_tokenizer()
    processor = _qwen_vl_processor(tok)
    if path is not None and processor.video_processor is None:
        raise InvalidArgumentError(
            "tiny_qwen_image_pipeline(path=...) saves the pipeline, but its Qwen3VLProcessor has no video processor "
            "without torchvision (transformers' Qwen3VLVideoProcessor needs it): install torchvision, or build the "
            "pipeline in-process with tiny_qwen_image_pipeline() and save single components."
        )
    latent, text_dim = 8, 16
    torch.manual_seed(seed)
    transformer = QwenImage21Transformer2DModel(
        patch_size=1,
        in_channels=latent,
        out_channels=latent,
        num_layers=2,
        attention_head_dim=16,  # = sum(axes_dims_rope)
        num_attention_heads=4,
        context_in_dim=text_dim,
        mlp_ratio=2,
        axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKLQwenImage21(
        base_dim=4,
        decoder_base_dim=4,
        z_dim=latent,
        dim_mult=[1, 1, 1, 1, 1],  # four downsamples: the 16x the pipeline assumes
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True, True],
        latents_mean=[0.0] * latent,
        latents_std=[1.0] * latent,
    )
    ids = {name: tok.convert_tokens_to_ids(f"<|{name}|>") for name in ("image_pad", "video_pad")}
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": text_dim,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": text_dim,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"],
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
    )
    pipe = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=Qwen3VLForConditionalGeneration(config),
        processor=processor,
        transformer=transformer,
    )
    from hf_tpu.diffusers._tiny_common import finish_pipeline

    return finish_pipeline(pipe, path)
