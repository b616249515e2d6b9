"""One-token attention on a tpu device as grouped products (hf_tpu/transformers/_decode_attention.py): the same
numbers as torch's sdpa on CPU, the flash kernel no longer in a decode step's graph, prefill and other devices
untouched, the form chosen by ``HF_TPU_DECODE_ATTENTION``."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_utils import AttentionInterface

from hf_tpu.transformers import _decode_attention

KW = {"do_sample": False, "eos_token_id": None}


def _inputs(batch=3, heads=8, kv_heads=2, slots=11, dim=16, vdim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, dim, generator=g)
    k = torch.randn(batch, kv_heads, slots, dim, generator=g)
    v = torch.randn(batch, kv_heads, slots, vdim, generator=g)
    keep = torch.rand(batch, 1, 1, slots, generator=g) > 0.3
    keep[..., -1] = True  # the token itself is always attended
    return q, k, v, keep


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
@pytest.mark.parametrize("vdim", [16, 8])
def test_grouped_form_equals_sdpa_on_cpu(mask_kind, vdim):
    q, k, v, keep = _inputs(vdim=vdim)
    mask = {"bool": keep, "none": None,
            "additive": torch.where(keep, 0.0, torch.finfo(torch.float32).min)}[mask_kind]  # fmt: skip
    got = _decode_attention.grouped_decode_attention(q, k, v, mask, None)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    scaled = _decode_attention.grouped_decode_attention(q, k, v, mask, 0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5, enable_gqa=True)
    torch.testing.assert_close(scaled, want, rtol=1e-5, atol=1e-6)


def test_bfloat16_scores_and_softmax_in_float32():
    q, k, v, keep = _inputs(slots=300, dim=64, vdim=64)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = _decode_attention.grouped_decode_attention(q, k, v, keep, None)
    assert got.dtype == torch.bfloat16
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep,
                                                            enable_gqa=True)  # fmt: skip
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def _spy_on_sdpa(monkeypatch):
    seen = []
    upstream = torch.nn.functional.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        if query.device.type == "tpu":
            seen.append(query.shape[2])
        return upstream(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def test_a_decode_step_on_tpu_takes_the_grouped_form_and_prefill_keeps_sdpa(pair, monkeypatch):
    cpu, tpu = pair("llama")
    assert tpu.config.num_key_value_heads < tpu.config.num_attention_heads
    seen = _spy_on_sdpa(monkeypatch)
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = tpu(input_ids=ids.to("tpu"), use_cache=True)
        step = tpu(input_ids=ids[:, -1:].to("tpu"), past_key_values=out.past_key_values, use_cache=True)
        want_out = cpu(input_ids=ids, use_cache=True)
        want_step = cpu(input_ids=ids[:, -1:], past_key_values=want_out.past_key_values, use_cache=True)
    assert seen and set(seen) == {6}, seen  # the prompt through sdpa, the one-token step not
    torch.testing.assert_close(step.logits.cpu(), want_step.logits, rtol=1e-5, atol=1e-5)
    prompt = ids[:1]
    assert torch.equal(tpu.generate(prompt, max_new_tokens=6, **KW), cpu.generate(prompt, max_new_tokens=6, **KW))


def test_the_sdpa_form_and_a_bad_name(pair, monkeypatch):
    _, tpu = pair("llama")
    seen = _spy_on_sdpa(monkeypatch)
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(2))
    monkeypatch.setenv(_decode_attention.ENV, "sdpa")
    with torch.no_grad():
        out = tpu(input_ids=ids.to("tpu"), use_cache=True)
        tpu(input_ids=ids[:, -1:].to("tpu"), past_key_values=out.past_key_values, use_cache=True)
    assert seen == [5] * tpu.config.num_hidden_layers + [1] * tpu.config.num_hidden_layers
    monkeypatch.setenv(_decode_attention.ENV, "flash")
    with pytest.raises(ValueError, match="HF_TPU_DECODE_ATTENTION='flash'.*grouped, sdpa, packed"):
        _decode_attention.decode_attention_form()


def test_a_paged_cache_handed_to_the_call_keeps_upstreams_sdpa(monkeypatch):
    """transformers 5.23's sdpa call updates a continuous-batching paged cache passed as ``cache``: a one-token
    query with one must reach upstream (which 5.24 ignores the argument in), not the grouped form."""
    seen = _spy_on_sdpa(monkeypatch)
    wrapper = AttentionInterface._global_mapping["sdpa"]
    q, k, v, keep = (t.to("tpu") for t in _inputs())

    class Module(torch.nn.Module):
        num_key_value_groups = 4
        is_causal = True

    wrapper(Module(), q, k, v, keep)
    assert seen == []  # no cache: the grouped products
    wrapper(Module(), q, k, v, keep, cache=object())
    assert seen == [1]


def test_other_devices_reach_upstream_and_disable_restores_it():
    import hf_tpu

    wrapper = AttentionInterface._global_mapping["sdpa"]
    upstream = wrapper.__hf_tpu_upstream__
    q, k, v, keep = _inputs()

    class Module(torch.nn.Module):
        num_key_value_groups = 4
        is_causal = True

    got, _ = wrapper(Module(), q, k, v, keep)
    want, _ = upstream(Module(), q, k, v, keep)
    assert torch.equal(got, want)  # a CPU tensor: upstream's own call, bit for bit
    hf_tpu.disable("generation")
    try:
        assert AttentionInterface._global_mapping["sdpa"] is upstream
    finally:
        hf_tpu.enable("generation")
    assert AttentionInterface._global_mapping["sdpa"].__hf_tpu_upstream__ is upstream


def test_the_ragged_kernel_form_generates_the_cpus_tokens(from_config, prompts, monkeypatch):
    """``HF_TPU_DECODE_ATTENTION=ragged_kernel``: a decode step's attention is the decode-attention-tpu Hub kernel's
    op (its torch reference on the simulator), and a left-padded batch of a tiny GQA Llama generates the CPU's
    tokens. A model of its own, so its graphs are traced under the variable."""
    from transformers import LlamaForCausalLM

    from hf_tpu.testing import tiny_config

    monkeypatch.setenv(_decode_attention.ENV, "ragged_kernel")
    assert _decode_attention.decode_attention_form() == "ragged_kernel"
    kernel = _decode_attention.load_ragged_kernel()  # (the variable set after enable: loaded outside the trace)
    calls = []
    op = kernel.decode_attention_op

    def spy(*args):
        calls.append(tuple(args[0].shape))
        return op(*args)

    monkeypatch.setattr(kernel._ops, "decode_attention_op", spy)
    cpu, tpu = from_config(LlamaForCausalLM, tiny_config("llama", vocab_size=96))
    assert tpu.config.num_key_value_heads < tpu.config.num_attention_heads
    ids, mask = prompts([3, 9, 6])  # batch 3, left padding
    want = cpu.generate(ids, attention_mask=mask, max_new_tokens=6, **KW)
    got = tpu.generate(ids, attention_mask=mask, max_new_tokens=6, **KW)
    assert torch.equal(got, want)
    assert calls and all(shape[0] == 3 and shape[2] == 1 for shape in calls), calls


def test_the_ragged_kernel_loads_at_enable_and_a_trace_without_it_says_so(monkeypatch):
    """Set before ``hf_tpu.enable()``, the variable makes enable load the kernel (outside any trace); a compiled
    graph that needs it before it is loaded (the variable set later) raises, naming the fix."""
    import hf_tpu
    from hf_tpu.errors import SetupError

    monkeypatch.setattr(_decode_attention, "_KERNEL", [])
    monkeypatch.setenv(_decode_attention.ENV, "ragged_kernel")
    hf_tpu.disable("generation")
    hf_tpu.enable("generation")
    assert len(_decode_attention._KERNEL) == 1 and callable(_decode_attention._KERNEL[0].decode_attention)
    monkeypatch.setattr(_decode_attention, "_KERNEL", [])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(SetupError, match=r"set after hf_tpu.enable\('generation'\).*load_ragged_kernel\(\)"):
        _decode_attention.ragged_kernel_decode_attention(*_inputs(), None)
