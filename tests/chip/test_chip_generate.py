"""``generate`` on the chip against the CPU's in the same test: greedy for dense (Llama, batch 1 and 4), MoE
(Qwen3-MoE at hf_tpu's default experts choice, batch 1 and 4), sliding-window (Mistral, Gemma 3), a vision-language
model (LLaVA) and Whisper; seeded sampling; logits at the device's default precision and in bfloat16.

Greedy tokens are compared exactly at float32 matmul precision ``'highest'`` (tiny models whose weights are scaled
up, so that no two logits tie); float outputs at the device's default precision ('medium' on a chip) within
:mod:`hf_tpu.numerics`' tolerance; sampling by what does not depend on the device's random numbers: one seed gives
one answer, and every sampled token is within the CPU's top-k/top-p set at its step.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.chip

NEW = 12
_PAIRS: dict[tuple, tuple] = {}


def pair(family: str, tmp_path_factory, dtype: str = "float32", scale: float = 4.0) -> tuple:
    """(cpu_model, tpu_model) of hf_tpu.testing's tiny ``family``, its weights scaled by ``scale`` (sharpened: no
    greedy ties), saved once and loaded back on each device (the tpu one through ``device_map="tpu"``)."""
    key = (family, dtype, scale)
    if key not in _PAIRS:
        import torch
        from _chip_models import saved_decoder
        from transformers import AutoModelForCausalLM

        path = saved_decoder(family, tmp_path_factory.getbasetemp() / f"chip-{family}-x{scale:g}", scale)
        kwargs = {"dtype": getattr(torch, dtype)}
        cpu = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
        tpu = AutoModelForCausalLM.from_pretrained(path, device_map="tpu", **kwargs).eval()
        assert next(tpu.parameters()).device.type == "tpu"
        _PAIRS[key] = (cpu, tpu)
    return _PAIRS[key]


def _greedy(chip, cpu, tpu, batch: int, *, seed: int = 0, lengths=None, new: int = NEW) -> None:
    from _chip_models import prompts

    ids, mask = prompts(batch, lengths, seed=seed)
    kwargs = {"attention_mask": mask, "max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
    with chip.precision("highest"):
        got = tpu.generate(ids, **kwargs)
        want = cpu.generate(ids, **kwargs)
    assert got.device.type == "cpu"
    chip.tokens(got, want)


@pytest.mark.parametrize("batch", [1, 4])
def test_llama_greedy_equals_cpu(tpu, chip, tmp_path_factory, batch):
    cpu, model = pair("llama", tmp_path_factory)
    _greedy(chip, cpu, model, batch, seed=batch)


@pytest.mark.parametrize("batch", [1, 4])
def test_qwen3_moe_greedy_at_the_default_experts_equals_cpu(tpu, chip, tmp_path_factory, batch):
    cpu, model = pair("qwen3_moe", tmp_path_factory)
    _greedy(chip, cpu, model, batch, seed=10 + batch)


def test_mistral_sliding_window_greedy_equals_cpu(tpu, chip, tmp_path_factory):
    """A window of 6 tokens, prompts of 12 and 9, 16 new tokens: the window slides through prefill and decode."""
    cpu, model = pair("mistral", tmp_path_factory)
    _greedy(chip, cpu, model, 2, seed=20, lengths=[12, 9], new=16)


def test_gemma3_sliding_and_full_layers_greedy_equals_cpu(tpu, chip, tmp_path_factory):
    cpu, model = pair("gemma3", tmp_path_factory)
    _greedy(chip, cpu, model, 2, seed=21, lengths=[12, 7], new=16)


def test_llama_logits_at_the_default_precision_are_within_its_tolerance(tpu, chip, tmp_path_factory):
    """One forward at the device's default float32 matmul precision (a chip's 'medium': one bfloat16 pass), the
    tiny Llama's own weights (not sharpened: scaled weights scale the drift too); 4 layers as the self-test counts."""
    import torch
    from _chip_models import prompts

    cpu, model = pair("llama", tmp_path_factory, scale=1.0)
    ids, _ = prompts(2, [12, 12], seed=30)
    with torch.no_grad():
        got = model(input_ids=ids.to("tpu")).logits
        want = cpu(input_ids=ids).logits
    chip.close(got, want, layers=4, what="the logits")


def test_llama_bfloat16_logits_and_greedy_tokens(tpu, chip, tmp_path_factory):
    """The model in bfloat16 on both sides: logits within a few bf16 steps of the CPU's, greedy tokens equal where
    the CPU's two best logits are more than a bf16 step apart (up to the first such tie)."""
    import torch
    from _chip_models import prompts

    cpu, model = pair("llama", tmp_path_factory, dtype="bfloat16")
    ids, _ = prompts(1, [12], seed=31)
    with torch.no_grad():
        chip.bf16_close(model(input_ids=ids.to("tpu")).logits.cpu(), cpu(input_ids=ids).logits, what="bf16 logits")
    got = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    ref = cpu.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, output_scores=True,
                       return_dict_in_generate=True)  # fmt: skip
    want = ref.sequences
    at = int((got[0] != want[0]).nonzero()[0]) if not torch.equal(got, want) else got.shape[1]
    if at < got.shape[1]:  # a tie at bfloat16: the CPU's choice and the device's one bf16 step apart at most
        scores = ref.scores[at - ids.shape[1]][0].float()
        assert scores[want[0, at]] - scores[got[0, at]] <= scores[want[0, at]].abs() * 2**-7, (at, got, want)
    chip.tokens(got[:, :at], want[:, :at], what="bf16 greedy tokens before a tie", precision="bfloat16")


def _llava():
    import transformers as T

    text = T.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)  # fmt: skip
    vision = T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=16, patch_size=4, projection_dim=32)  # fmt: skip
    config = T.LlavaConfig(vision_config=vision, text_config=text, image_token_id=90,
                           image_seq_length=17, vision_feature_select_strategy="full", vision_feature_layer=-1)  # fmt: skip
    return T.LlavaForConditionalGeneration, config


def test_llava_greedy_with_an_image_equals_cpu(tpu, chip):
    """The tiny LLaVA of tests/transformers/test_vision_generate.py (CLIP tower, 17 image tokens per 16x16 image),
    pixels left on the host; 12 new tokens."""
    import torch
    from _chip_models import sharpened

    cls, config = _llava()
    torch.manual_seed(0)
    cpu = sharpened(cls(config).eval(), 2.0)
    model = cls(config).eval()
    model.load_state_dict(cpu.state_dict())
    model = model.to("tpu")
    g = torch.Generator().manual_seed(40)
    ids = torch.cat([torch.randint(3, 60, (1, 5), generator=g), torch.full((1, 17), 90),
                     torch.randint(3, 60, (1, 3), generator=g)], dim=1)  # fmt: skip
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "pixel_values": torch.randn(1, 3, 16, 16, generator=g), "max_new_tokens": NEW,
              "min_new_tokens": NEW, "do_sample": False}  # fmt: skip
    with chip.precision("highest"):
        got = model.generate(**kwargs)
        want = cpu.generate(**kwargs)
    chip.tokens(got, want)


def test_whisper_greedy_equals_cpu(tpu, chip):
    """The tiny Whisper of tests/transformers/test_speech_generate.py, features on the host, with and without a
    language and task."""
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=96, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
        max_target_positions=64, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1,
        init_std=0.3,
    )  # fmt: skip
    gen = GenerationConfig(
        decoder_start_token_id=1, eos_token_id=2, pad_token_id=0, bos_token_id=1, is_multilingual=True,
        lang_to_id={"<|en|>": 90, "<|fr|>": 91}, task_to_id={"transcribe": 92, "translate": 93},
        no_timestamps_token_id=94, suppress_tokens=[5, 6], begin_suppress_tokens=[2], max_length=64,
    )  # fmt: skip
    torch.manual_seed(0)
    cpu = WhisperForConditionalGeneration(config).eval()
    model = WhisperForConditionalGeneration(config).eval()
    model.load_state_dict(cpu.state_dict())
    cpu.generation_config = model.generation_config = gen
    model = model.to("tpu")
    features = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(41))
    got, want = [], []
    with chip.precision("highest"):
        for kwargs in ({"language": "fr", "task": "transcribe"}, {}):
            got.append(model.generate(features, max_new_tokens=8, min_new_tokens=8, **kwargs))
            want.append(cpu.generate(features, max_new_tokens=8, min_new_tokens=8, **kwargs))
    chip.tokens(torch.cat(got), torch.cat(want))


SAMPLE = {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9}


def _sampled(model, ids, seed: int):
    import torch

    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, **SAMPLE)


def test_seeded_sampling_gives_one_answer_per_seed(tpu, chip, tmp_path_factory):
    """Two runs with one seed give the same tokens (batch 2, temperature, top-k, top-p in the decode graph)."""
    from _chip_models import prompts

    _, model = pair("llama", tmp_path_factory)
    ids, _ = prompts(2, [10, 10], seed=50)
    with chip.precision("highest"):
        first, second = _sampled(model, ids, 7), _sampled(model, ids, 7)
    chip.tokens(second, first, what="a second run's tokens with the same seed")


def test_every_sampled_token_is_within_the_cpus_top_k_top_p_set(tpu, chip, tmp_path_factory):
    """Whatever the device's random numbers, each token the device samples is one the CPU's warpers (temperature,
    top-k 20, top-p 0.9, upstream's order) keep at that step, given the same sequence so far."""
    import torch
    from _chip_models import prompts
    from transformers.generation import logits_process as lp

    cpu, model = pair("llama", tmp_path_factory)
    ids, _ = prompts(2, [10, 10], seed=51)
    with chip.precision("highest"):
        out = _sampled(model, ids, 3)
    warp = lp.LogitsProcessorList([lp.TemperatureLogitsWarper(SAMPLE["temperature"]),
                                   lp.TopKLogitsWarper(SAMPLE["top_k"]), lp.TopPLogitsWarper(SAMPLE["top_p"])])  # fmt: skip
    outside = 0
    with torch.no_grad():
        logits = cpu(input_ids=out).logits.float()
    start = ids.shape[1]
    for step in range(out.shape[1] - start):
        pos = start + step
        kept = torch.isfinite(warp(out[:, :pos], logits[:, pos - 1].clone()))
        outside += int((~kept.gather(1, out[:, pos : pos + 1])).sum())
    chip.count(outside, what="sampled tokens outside the CPU's top-k/top-p set")
