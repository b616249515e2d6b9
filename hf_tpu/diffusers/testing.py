"""Tiny diffusion pipelines built from configs, for tests, examples and benchmarks (nothing is downloaded).

The components are random and far too small to draw anything, but they exercise every code path of the real
pipelines: text encoders (CLIP, T5), tokenizers built locally, the denoiser (an SD3 transformer or a UNet), the
scheduler and the VAE. :func:`tiny_sd3_pipeline` and :func:`tiny_sd_pipeline` return a pipeline on the CPU, or
save it with ``save_pretrained`` and return the directory when ``path`` is given.

Example:
    >>> from hf_tpu.diffusers.testing import tiny_sd3_pipeline
    >>> pipe = tiny_sd3_pipeline()
    >>> image = pipe("a cat", num_inference_steps=2, height=32, width=32, output_type="np").images[0]
    >>> image.shape
    (32, 32, 3)
"""

from __future__ import annotations

import os
import string
from typing import Any

from hf_tpu.diffusers._tiny_common import byte_chars, finish_pipeline

# Qwen-Image and MiniMax-H3 (modular, video + audio) live in modules of their own; re-exported here.
from hf_tpu.diffusers._tiny_minimax_h3 import qwen3vl_tokenizer, tiny_minimax_h3_pipeline
from hf_tpu.diffusers._tiny_qwen_image import qwen_tokenizer, tiny_qwen_image_pipeline

__all__ = [
    "clip_tokenizer",
    "qwen_tokenizer",
    "t5_tokenizer",
    "qwen3vl_tokenizer",
    "tiny_flux_pipeline",
    "tiny_qwen_image_pipeline",
    "tiny_minimax_h3_pipeline",
    "tiny_sd3_pipeline",
    "tiny_sd_controlnet_pipeline",
    "tiny_sd_pipeline",
    "tiny_wan_pipeline",
]

_MAX_TEXT_LENGTH = 16  # CLIP tokens per prompt in the tiny pipelines


def clip_tokenizer(model_max_length: int = _MAX_TEXT_LENGTH) -> Any:
    """A character-level CLIP tokenizer (byte-level BPE with no merges), about 500 tokens."""
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in byte_chars():
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def t5_tokenizer(model_max_length: int = 64) -> Any:
    """A small unigram T5 tokenizer over letters, digits and punctuation, about 80 pieces."""
    from transformers import T5Tokenizer

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    for ch in string.ascii_lowercase + string.digits + ".,!?'-":
        pieces.append((ch, -3.0))
        if ch.isalnum():
            pieces.append(("▁" + ch, -2.5))
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def _clip_config(projection: bool, vocab_size: int) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        hidden_size=32,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=_MAX_TEXT_LENGTH,
        vocab_size=vocab_size,
        hidden_act="gelu",
        projection_dim=32 if projection else 512,
    )


def _t5_encoder(vocab_size: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size,
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return T5EncoderModel(config)


def _flow_vae(latent_channels: int) -> Any:
    """The tiny VAE of the flow-matching pipelines (SD3, Flux): halves the resolution, SD3's shift and scale."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=2,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )


def tiny_flux_pipeline(path: str | os.PathLike | None = None, *, seed: int = 0) -> Any:
    """A tiny :class:`diffusers.FluxPipeline` (CLIP, T5, a Flux transformer with a tensor-parallel plan, VAE).

    Flux is one of the models diffusers can shard with ``TensorParallelConfig`` (SD3 and the UNets declare no
    ``_tp_plan``); its 2 attention heads split over 2 ranks. The VAE halves the resolution and the pipeline packs
    2x2 latents, so an image side must be a multiple of 4. Returns the pipeline, or the directory it was saved to.
    """
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tok = clip_tokenizer()
    tokenizer_2 = t5_tokenizer()
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,  # 1 latent channel, packed 2x2
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )
    vae = _flow_vae(latent_channels=1)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=CLIPTextModel(_clip_config(False, len(tok))),
        tokenizer=tok,
        text_encoder_2=_t5_encoder(len(tokenizer_2)),
        tokenizer_2=tokenizer_2,
        transformer=transformer,
        vae=vae,
    )
    return finish_pipeline(pipe, path)


def tiny_sd3_pipeline(
    path: str | os.PathLike | None = None, *, seed: int = 0, with_t5: bool = True, latent_channels: int = 4
) -> Any:
    """A tiny :class:`diffusers.StableDiffusion3Pipeline` (two CLIP encoders, a T5 encoder, an SD3 transformer).

    The VAE halves the resolution and the transformer's patch is 2, so an image side must be a multiple of 4.
    ``latent_channels=16`` gives SD3's real latent width (the SD3 inpainting pipeline insists on it).
    Returns the pipeline, or the directory it was saved to when ``path`` is given.
    """
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    tok = clip_tokenizer()
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=latent_channels,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,  # the two CLIP projections, concatenated
        out_channels=latent_channels,
    )
    text_encoder = CLIPTextModelWithProjection(_clip_config(True, len(tok)))
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(True, len(tok)))
    text_encoder_3 = tokenizer_3 = None
    if with_t5:
        tokenizer_3 = t5_tokenizer()
        text_encoder_3 = _t5_encoder(len(tokenizer_3))
    vae = _flow_vae(latent_channels=latent_channels)
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=text_encoder,
        tokenizer=tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
        transformer=transformer,
        vae=vae,
    )
    return finish_pipeline(pipe, path)


def tiny_sd_pipeline(path: str | os.PathLike | None = None, *, seed: int = 0) -> Any:
    """A tiny :class:`diffusers.StableDiffusionPipeline` (CLIP encoder, UNet2DConditionModel, DDIM, VAE).

    The VAE divides the resolution by 8 (the multiple the pipeline checks for), the UNet has two levels.
    Returns the pipeline, or the directory it was saved to when ``path`` is given.
    """
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    tok = clip_tokenizer()
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=4,
        norm_num_groups=4,
    )
    text_encoder = CLIPTextModel(_clip_config(False, len(tok)))
    vae = AutoencoderKL(  # four levels: the VAE scale is 8, as the SD pipeline's own size check assumes
        sample_size=32,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=2,
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return finish_pipeline(pipe, path)


def tiny_wan_pipeline(path: str | os.PathLike | None = None, *, seed: int = 0, two_experts: bool = False) -> Any:
    """A tiny :class:`diffusers.WanPipeline` (T5 encoder, a Wan transformer with a ``(1, 2, 2)`` patch, Wan VAE).

    With ``two_experts=True`` it is Wan 2.2's layout: a high-noise ``transformer`` and a low-noise ``transformer_2``
    switched at ``boundary_ratio=0.5``. The VAE divides sides by 8 and time by 4, so an image side must be a multiple
    of 16 and a clip has ``4k + 1`` frames. Returns the pipeline, or the directory it was saved to.
    """
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    tokenizer = t5_tokenizer()
    torch.manual_seed(seed)

    def transformer() -> Any:
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=4,
            out_channels=4,
            text_dim=32,
            freq_dim=32,
            ffn_dim=32,
            num_layers=2,
            rope_max_seq_len=32,
        )

    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=_t5_encoder(len(tokenizer)),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=transformer(),
        transformer_2=transformer() if two_experts else None,
        boundary_ratio=0.5 if two_experts else None,
    )
    return finish_pipeline(pipe, path)


def tiny_sd_controlnet_pipeline(path: str | os.PathLike | None = None, *, seed: int = 0) -> Any:
    """A tiny :class:`diffusers.StableDiffusionControlNetPipeline`: :func:`tiny_sd_pipeline`'s components and a
    ControlNet of the UNet's shape (its conditioning image is full resolution; sides are multiples of 8).
    Returns the pipeline, or the directory it was saved to."""
    import torch
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    base = tiny_sd_pipeline(seed=seed)
    torch.manual_seed(seed + 1)
    controlnet = ControlNetModel(
        in_channels=4,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=4,
        norm_num_groups=4,
        conditioning_embedding_out_channels=(4, 8, 8, 8),
    )
    components = {k: v for k, v in base.components.items() if k not in ("image_encoder",)}
    pipe = StableDiffusionControlNetPipeline(**components, controlnet=controlnet)
    return finish_pipeline(pipe, path)
