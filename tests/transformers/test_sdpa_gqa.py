"""Grouped-query attention reaches sdpa with its KV heads on a tpu device (hf_tpu/transformers/_sdpa_gqa.py): no
``repeat_kv`` expansion in the graphs torch_tpu compiles; the numbers as on CPU, where upstream repeats the heads."""

from __future__ import annotations

import torch
from transformers.integrations import sdpa_attention

from hf_tpu._patch import original

KW = {"do_sample": False, "eos_token_id": None}


def test_use_gqa_in_sdpa_says_yes_for_tpu_tensors_only():
    k, v = torch.empty(1, 2, 5, 8, device="tpu"), torch.empty(1, 2, 5, 8, device="tpu")
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool, device="tpu")
    assert sdpa_attention.use_gqa_in_sdpa is not original(sdpa_attention, "use_gqa_in_sdpa")
    assert sdpa_attention.use_gqa_in_sdpa(mask, k, v)
    # upstream's answer elsewhere: with a mask on the CPU it repeats the heads
    assert not sdpa_attention.use_gqa_in_sdpa(mask.cpu(), k.cpu(), v.cpu())
    # key and value heads of different sizes: upstream's answer too
    assert not sdpa_attention.use_gqa_in_sdpa(mask, k, torch.empty(1, 2, 5, 4, device="tpu"))


def test_llama_attention_gets_its_kv_heads_and_matches_cpu(pair, monkeypatch):
    cpu, tpu = pair("llama")
    config = tpu.config
    assert config.num_key_value_heads < config.num_attention_heads  # the tiny llama is a GQA model
    seen = []
    upstream = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        if query.device.type == "tpu":
            seen.append((query.shape[1], key.shape[1], kwargs.get("enable_gqa", False)))
        return upstream(query, key, value, *args, **kwargs)

    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: sdpa gets a mask
    with monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        with torch.no_grad():
            got = tpu(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu")).logits.cpu()
    with torch.no_grad():
        want = cpu(input_ids=ids, attention_mask=mask).logits
    heads = (config.num_attention_heads, config.num_key_value_heads, True)
    assert seen and set(seen) == {heads}, seen
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0, 2:], want[0, 2:], rtol=1e-5, atol=1e-5)
    prompt = ids[:1]
    assert torch.equal(tpu.generate(prompt, max_new_tokens=5, **KW), cpu.generate(prompt, max_new_tokens=5, **KW))
