"""Whisper's ``generate`` (speech in, text out) on hf_tpu's seq2seq loop: its own generate hands the features to
``GenerationMixin.generate``, where hf_tpu runs the encoder once as a compiled graph and the decoder as its cached
loop, with the features left on the host as for text. Compared with the same model's greedy generate on the CPU."""

from __future__ import annotations

import pytest
import torch

import hf_tpu
from hf_tpu.transformers import explain, generation

# special ids of the tiny vocabulary: start, end, pad, two languages, two tasks, no-timestamps
SOT, EOS, PAD, EN, FR, TRANSCRIBE, TRANSLATE, NO_TS = 1, 2, 0, 90, 91, 92, 93, 94


@pytest.fixture(scope="module")
def whisper():
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=96, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
        max_target_positions=64, decoder_start_token_id=SOT, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=SOT,
        init_std=0.3,  # (varied tokens from random weights)
    )  # fmt: skip
    gen = GenerationConfig(
        decoder_start_token_id=SOT, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=SOT, is_multilingual=True,
        lang_to_id={"<|en|>": EN, "<|fr|>": FR}, task_to_id={"transcribe": TRANSCRIBE, "translate": TRANSLATE},
        no_timestamps_token_id=NO_TS, suppress_tokens=[5, 6], begin_suppress_tokens=[EOS], max_length=64,
    )  # fmt: skip
    torch.manual_seed(0)
    cpu = WhisperForConditionalGeneration(config).eval()
    tpu = WhisperForConditionalGeneration(config).eval()
    tpu.load_state_dict(cpu.state_dict())
    cpu.generation_config = gen
    tpu.generation_config = gen
    return cpu, tpu.to("tpu")


def _features(batch: int, seed: int) -> torch.Tensor:
    # the tiny model's 16 encoder positions take 32 frames (two stride-1/stride-2 convolutions), 8 mel bins
    return torch.randn(batch, 8, 32, generator=torch.Generator().manual_seed(seed))


def test_whisper_greedy_with_language_and_task_equals_cpu_from_host_features(whisper):
    cpu, tpu = whisper
    features = _features(2, 0)  # left on the host, as the feature extractor returns them
    assert explain(tpu, input_features=features, max_new_tokens=8).loop == "cached"
    for kwargs in ({"language": "fr", "task": "transcribe"}, {"language": "en", "task": "translate"}, {}):
        want = cpu.generate(features, max_new_tokens=8, **kwargs)
        got = tpu.generate(features, max_new_tokens=8, **kwargs)
        assert got.device.type == "cpu"
        assert torch.equal(got, want), kwargs
    on_device = tpu.generate(features.to("tpu"), max_new_tokens=8)  # features already there: the result too
    assert on_device.device.type == "tpu"
    assert torch.equal(on_device.cpu(), cpu.generate(features, max_new_tokens=8))
    kinds = {key[0].split("+", 1)[0] for key in generation.compiled_graphs(tpu)}
    assert kinds == {"features_encoder", "seq2seq_prefill", "seq2seq_decode"}


def test_whisper_second_clip_compiles_nothing_and_copies_one_small_tensor_each_way_per_step(whisper):
    cpu, tpu = whisper

    def run(features, new_tokens):
        with hf_tpu.sim.stats() as s:
            out = tpu.generate(features, language="fr", max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        assert torch.equal(
            out, cpu.generate(features, language="fr", max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        )
        return s

    run(_features(2, 1), 10)  # compiles this call's shapes
    short, long = run(_features(2, 2), 2), run(_features(2, 3), 10)  # other clips (same bucket: Whisper's window)
    assert short.compiles == long.compiles == 0
    assert long.shape_signatures == 0
    steps = 8
    assert (long.h2d_copies - short.h2d_copies) / steps <= 1
    assert (long.d2h_copies - short.d2h_copies) / steps <= 1
    assert (long.d2h_bytes - short.d2h_bytes) / steps <= 2 * 8  # the batch's next tokens only
    assert (long.host_syncs - short.host_syncs) / steps <= 1


def test_whisper_beam_search_runs_upstream_with_its_reason_and_takes_host_features(whisper):
    cpu, tpu = whisper
    features = _features(1, 4)
    assert "beam search on an encoder-decoder model" in explain(tpu, input_features=features, num_beams=2).reason
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="beam search on an encoder-decoder model"):
        got = tpu.generate(features, num_beams=2, max_new_tokens=6)
    assert torch.equal(got.cpu(), cpu.generate(features, num_beams=2, max_new_tokens=6))


def test_whisper_warmup_then_every_clip_compiles_nothing(whisper):
    """``hf_tpu.warmup`` runs Whisper's own generate on silent features of its window per batch size, with the
    call's language and task (they set the decoder prompt); afterwards, in strict mode (a graph warm-up missed would
    raise), clips of that batch size compile nothing, for any max_new_tokens up to the warmed one."""
    cpu, tpu = whisper
    report = hf_tpu.warmup(
        tpu, batch_sizes=[1, 3], max_new_tokens=8, generate_kwargs={"language": "en", "task": "translate"},
        strict=True, progress=False,
    )  # fmt: skip
    kinds = {(key[0].split("+", 1)[0], key[1]) for key in report.graphs}
    assert kinds == {(kind, b) for kind in ("features_encoder", "seq2seq_prefill", "seq2seq_decode") for b in (1, 3)}
    try:
        for batch, seed, new_tokens in [(1, 20, 8), (3, 21, 8), (3, 22, 5), (1, 23, 3)]:
            features = _features(batch, seed)
            with hf_tpu.sim.stats() as s:
                got = tpu.generate(features, language="en", task="translate", max_new_tokens=new_tokens)
            want = cpu.generate(features, language="en", task="translate", max_new_tokens=new_tokens)
            assert torch.equal(got, want), (batch, new_tokens)
            assert s.compiles == 0 and s.shape_signatures <= 4, (batch, s.compiles, s.shape_signatures)
    finally:
        generation.configure(tpu, strict=False)


def _whisper_processor(tmp_path):
    """A tokenizer of the tiny vocabulary (its special tokens at the ids above, one character per other id) and a
    feature extractor of 8 mel bins whose window is the tiny model's 32 frames (1 s at 5120 Hz, hop 160)."""
    import json

    from transformers import WhisperFeatureExtractor, WhisperTokenizer

    special = {"<pad>": PAD, "<|startoftranscript|>": SOT, "<|endoftext|>": EOS, "<|en|>": EN, "<|fr|>": FR}
    special.update({"<|transcribe|>": TRANSCRIBE, "<|translate|>": TRANSLATE, "<|notimestamps|>": NO_TS})
    letters = [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    free = [i for i in range(96) if i not in special.values()]
    vocab = {**special, **{(letters * 2)[n] + ("" if n < len(letters) else "_"): i for n, i in enumerate(free)}}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = WhisperTokenizer(
        str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), unk_token="<|endoftext|>",
        bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<pad>",
    )  # fmt: skip
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [t for t in special if t.startswith("<|") and "end" not in t]}
    )
    extractor = WhisperFeatureExtractor(feature_size=8, sampling_rate=5120, hop_length=160, chunk_length=1, n_fft=400)
    assert extractor.nb_max_frames == 32
    return tokenizer, extractor


def test_asr_pipeline_on_tpu_runs_hf_tpu_loop_and_equals_cpu(whisper, tmp_path):
    """``pipeline("automatic-speech-recognition", device="tpu")`` hands Whisper's generate the extractor's features
    (on the host) and reaches hf_tpu's loop with greedy search (the pipeline's own default is 5 beams, openai's:
    beam search), transcribing as the CPU pipeline does."""
    import numpy as np
    from transformers import pipeline

    cpu, tpu = whisper
    tokenizer, extractor = _whisper_processor(tmp_path)
    audio = np.random.default_rng(0).standard_normal(3000).astype(np.float32)  # 0.6 s: padded to the window
    greedy = {"language": "fr", "max_new_tokens": 8, "num_beams": 1}
    on_cpu = pipeline("automatic-speech-recognition", model=cpu, tokenizer=tokenizer, feature_extractor=extractor)
    on_tpu = pipeline(
        "automatic-speech-recognition", model=tpu, tokenizer=tokenizer, feature_extractor=extractor, device="tpu"
    )
    assert on_tpu.device.type == "tpu"
    want = on_cpu({"raw": audio, "sampling_rate": 5120}, generate_kwargs=greedy)
    got = on_tpu({"raw": audio, "sampling_rate": 5120}, generate_kwargs=greedy)
    assert got == want and want["text"]
    # the extractor's attention mask over the frames goes to the encoder graph (its key says a mask was given)
    assert ("features_encoder", 1, 8, 32, True) in generation.compiled_graphs(tpu)
