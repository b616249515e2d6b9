"""A tiny MiniMax-H3 (joint video + audio) Modular Diffusers pipeline built from configs; nothing is downloaded.

diffusers 0.42.1 ships MiniMax-H3 only as ``MiniMaxH3ModularPipeline`` (the ``MiniMaxH3Blocks``: ``t2va``, ``fl2va``,
``ref2va``). Its components are a Qwen3-VL conditioner with its tokenizer and processor, the MiniMax-H3 transformer
(one packed sequence of text, audio and video rows), a video VAE, an audio VAE and two schedulers. Here each is a
random model of a few thousand parameters, except that the conditioner keeps 51 decoder layers: MiniMax-H3 reads
``hidden_states[50]`` (``MiniMaxH3ModularPipeline.text_encoder_layer``, not configurable) and refuses a shallower
stack. Re-exported by :mod:`hf_tpu.diffusers.testing`.

Example:
    >>> from hf_tpu.diffusers.testing import tiny_minimax_h3_pipeline
    >>> pipe = tiny_minimax_h3_pipeline()
    >>> out = pipe(prompt="a cat", height=16, width=16, num_frames=124, num_inference_steps=2,
    ...            output_type="np", output=["videos", "audio"])  # doctest: +SKIP
    >>> out["videos"].shape, tuple(out["audio"].shape)  # doctest: +SKIP
    ((1, 124, 16, 16, 3), (1, 2, 828))
"""

from __future__ import annotations

from typing import Any

__all__ = ["qwen3vl_tokenizer", "tiny_minimax_h3_pipeline"]

# The tokens Qwen3-VL's processor and MiniMax-H3's keyframe presentation look up by name.
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_TEXT_HIDDEN = 32  # the conditioner's width, which is the transformer's text_dim


def qwen3vl_tokenizer() -> Any:
    """A byte-level Qwen2 tokenizer with no merges (one token per byte) and Qwen3-VL's vision tokens, 261 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    from hf_tpu.diffusers._tiny_common import byte_chars

    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars())}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tok = Qwen2TokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token=None, bos_token=None
    )
    tok.add_special_tokens({"additional_special_tokens": list(_VISION_TOKENS)})
    return tok


def _processor(tokenizer: Any) -> Any:
    """Qwen3-VL's processor without its video processor.

    ``Qwen3VLVideoProcessor`` needs torchvision, which CI's environment (``.[test,kernels,quant,serve]``) does not
    install, and ``ProcessorMixin`` refuses ``None`` for it. MiniMax-H3's ``t2va`` and ``fl2va`` presentations use the
    processor's token-type ids and its image processor only (video references, ``ref2va``, would need the real one).
    """
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class TextAndImageQwen3VLProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return TextAndImageQwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer, video_processor=None
    )


def _text_encoder(tokenizer: Any) -> Any:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _VISION_TOKENS}
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": _TEXT_HIDDEN,
            "intermediate_size": 37,
            "num_hidden_layers": 51,  # MiniMax-H3 reads hidden_states[50]
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": _TEXT_HIDDEN,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen3VLForConditionalGeneration(config)


def tiny_minimax_h3_pipeline(*, seed: int = 0) -> Any:
    """A tiny ``MiniMaxH3ModularPipeline`` (``MiniMaxH3Blocks``) with every ``t2va`` component, on the CPU.

    The video VAE divides sides by 4 and the transformer's patch is ``(1, 2, 2)``, so sides are multiples of 8
    (``pipe.canvas_multiple``); it encodes ``17 * n + 5`` frames to ``5 * n + 2`` latent frames, and MiniMax-H3
    generates 5 to 15 seconds at 24 fps, so the shortest clip is 124 frames (37 latent frames). The audio VAE hops 4
    samples at 160 Hz, MiniMax-H3's 40 latents per second (the released one hops 800 at 32 kHz): 124 frames carry
    207 audio latents per stereo channel, 828 samples each. The same ``seed`` gives the same weights.
    """
    import torch
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )
    from diffusers.modular_pipelines import MiniMaxH3Blocks

    tokenizer = qwen3vl_tokenizer()
    torch.manual_seed(seed)
    text_encoder = _text_encoder(tokenizer)
    transformer = MiniMaxH3Transformer3DModel(
        num_attention_heads=4,  # divisible by 4: the TP=4 launcher test shards whole heads
        attention_head_dim=16,
        hidden_size=32,
        num_layers=1,
        num_refiner_layers=1,
        ffn_dim=32,
        in_channels=4,
        audio_in_channels=4,
        patch_size=(1, 2, 2),
        text_dim=_TEXT_HIDDEN,
        freq_dim=16,
        time_embed_hidden_dim=32,
        time_embed_dim=16,
        rope_freq_dim=2,
    )
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=4,
        block_out_channels=(8, 8, 8),
        layers_per_block=1,
        spatial_downsample_factors=(2, 2, 1),
        temporal_downsample_factors=(1, 2, 2),  # the released 4x time compression: 17 frames -> 5 latent frames
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=8,
        decoder_num_register_tokens=1,
        decoder_ffn_mult=1,
        latents_mean=(0.0,) * 4,
        latents_std=(1.0,) * 4,
    )
    audio_vae = AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4,
        encoder_rates=(2, 2),
        latent_dim=8,
        latent_channels=4,
        num_attention_heads=2,
        decoder_dim=16,
        decoder_rates=(2, 2),
        decoder_kernel_sizes=(4, 4),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),),
        sampling_rate=160,
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        processor=_processor(tokenizer),
        transformer=transformer.eval(),
        vae=vae.eval(),
        audio_vae=audio_vae.eval(),
        scheduler=MiniMaxH3Scheduler(shift=12.0),  # the released video and audio shifts
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
