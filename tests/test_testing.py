"""hf_tpu.testing: every tiny family builds, saves, loads back equal, and runs on the simulated device like on CPU."""

from __future__ import annotations

import pytest
import torch

import hf_tpu.sim
from hf_tpu.testing import FAMILIES, tiny_config, tiny_model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_round_trips_and_matches_cpu_on_the_simulator(family, tmp_path):
    import transformers

    hf_tpu.sim.enable()
    model = tiny_model(family, tmp_path / family)
    assert not model.training
    assert sum(p.numel() for p in model.parameters()) < 500_000
    loaded = getattr(transformers, FAMILIES[family][1]).from_pretrained(tmp_path / family).eval()
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    kwargs = {"decoder_input_ids": ids[:, :3]} if model.config.is_encoder_decoder else {}
    with torch.no_grad():
        expected = model(ids, **kwargs).logits
        torch.testing.assert_close(loaded(ids, **kwargs).logits, expected, atol=0, rtol=0)
        on_tpu = loaded.to("tpu")(ids.to("tpu"), **{k: v.to("tpu") for k, v in kwargs.items()}).logits
    assert on_tpu.device.type == "tpu"
    torch.testing.assert_close(on_tpu.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_same_seed_same_weights_and_overrides_reach_the_config():
    a = tiny_model("llama", seed=3, num_key_value_heads=1, tie_word_embeddings=True)
    b = tiny_model("llama", seed=3, config=tiny_config("llama", num_key_value_heads=1, tie_word_embeddings=True))
    c = tiny_model("llama", seed=4, num_key_value_heads=1, tie_word_embeddings=True)
    assert a.config.num_key_value_heads == 1 and a.lm_head.weight is a.model.embed_tokens.weight
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="unknown tiny model family 'llma'; choose one of llama, qwen3"):
        tiny_config("llma")
    with pytest.raises(ValueError, match="either config= or config fields \\(hidden_size\\)"):
        tiny_model("llama", config=tiny_config("llama"), hidden_size=64)
