"""Tiny transformers models on the simulated tpu give the CPU's forward, gradients and greedy tokens.

Each model is built from a tiny config, saved with ``save_pretrained`` and loaded back twice through the real
``from_pretrained``: once for the CPU reference, once moved to ``tpu``. Batch 2 with left padding.
"""

import pytest
import torch
import transformers as tf

import hf_tpu.sim

V = 96  # vocab

_DEC = {
    "vocab_size": V,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
MODELS = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(_DEC)),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(_DEC, head_dim=8)),
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, dict(_DEC, head_dim=8)),
    "gpt2": (
        tf.GPT2Config,
        tf.GPT2LMHeadModel,
        {"vocab_size": V, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
    ),
    "bert": (
        tf.BertConfig,
        tf.BertForMaskedLM,
        {
            "vocab_size": V,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "max_position_embeddings": 64,
        },
    ),
    "t5": (
        tf.T5Config,
        tf.T5ForConditionalGeneration,
        {
            "vocab_size": V,
            "d_model": 32,
            "d_kv": 8,
            "d_ff": 64,
            "num_layers": 2,
            "num_heads": 4,
            "decoder_start_token_id": 0,
            "pad_token_id": 0,
        },
    ),
}
DECODERS = ("llama", "qwen3", "gemma", "gpt2")


def _load(name, tmp_path):
    config_cls, model_cls, kwargs = MODELS[name]
    torch.manual_seed(0)
    model_cls(config_cls(**kwargs)).save_pretrained(tmp_path)
    cpu = model_cls.from_pretrained(tmp_path).eval()
    tpu = model_cls.from_pretrained(tmp_path).eval().to("tpu")
    # torch's Module.to() replaces (rather than updates) parameters when moving to any PrivateUse1 device, real
    # torch_tpu included, which unties tied weights; tie them again as a user of .to("tpu") must.
    tpu.tie_weights()
    return cpu, tpu


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(3, V, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on the first row
    ids[0, :3] = 0
    return ids, mask


def _inputs(name, ids, mask, device):
    kw = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    if name == "t5":
        kw["decoder_input_ids"] = ids[:, :5].to(device)
    return kw


def _logits(out):
    return out.logits


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_and_training_step_match_cpu(name, tmp_path):
    cpu, tpu = _load(name, tmp_path)
    ids, mask = _batch()
    with torch.no_grad():
        ref = _logits(cpu(**_inputs(name, ids, mask, "cpu")))
        got = _logits(tpu(**_inputs(name, ids, mask, "tpu")))
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-5)

    labels = ids.clone() if name != "t5" else ids[:, :5].clone()
    cpu.train(), tpu.train()
    torch.manual_seed(5)
    loss_ref = cpu(**_inputs(name, ids, mask, "cpu"), labels=labels).loss
    torch.manual_seed(5)
    loss = tpu(**_inputs(name, ids, mask, "tpu"), labels=labels.to("tpu")).loss
    loss_ref.backward()
    loss.backward()
    torch.testing.assert_close(loss.cpu(), loss_ref, rtol=1e-4, atol=1e-5)
    grads_ref = dict(cpu.named_parameters())
    for pname, p in tpu.named_parameters():
        if grads_ref[pname].grad is None:
            assert p.grad is None, pname
            continue
        assert p.grad.device.type == "tpu", pname
        torch.testing.assert_close(p.grad.cpu(), grads_ref[pname].grad, rtol=1e-3, atol=1e-5, msg=pname)


@pytest.mark.parametrize("name", [*DECODERS, "t5"])
def test_greedy_generate_token_identical(name, tmp_path):
    cpu, tpu = _load(name, tmp_path)
    ids, mask = _batch()
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    ref = cpu.generate(input_ids=ids, attention_mask=mask, **kw)
    got = tpu.generate(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu"), **kw)
    assert got.device.type == "tpu"
    assert torch.equal(got.cpu(), ref)


def test_compiled_llama_forward_matches_cpu_and_counts_compiles(tmp_path):
    torch._dynamo.reset()
    cpu, tpu = _load("llama", tmp_path)
    ids, mask = _batch()
    forward = torch.compile(tpu.forward, backend="tpu", dynamic=False)
    with torch.no_grad(), hf_tpu.sim.stats() as s:
        got = forward(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu")).logits
        forward(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu"))
        ref = cpu(input_ids=ids, attention_mask=mask).logits
    assert s.compiles >= 1
    first = s.compiles
    with torch.no_grad(), hf_tpu.sim.stats() as s2:
        forward(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu"))
    assert s2.compiles == 0 and first == s.compiles
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_moe_experts_implementations_match_cpu(experts, tmp_path):
    """transformers' grouped_mm experts path counts tokens per expert with ``histc`` on integer ids for any
    non-CPU device: the simulator must take it (the CPU kernel alone refuses integer inputs)."""
    config = tf.Qwen3MoeConfig(
        **dict(_DEC, head_dim=8), moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2
    )
    torch.manual_seed(0)
    tf.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    cpu = tf.Qwen3MoeForCausalLM.from_pretrained(tmp_path, experts_implementation=experts).eval()
    dev = tf.Qwen3MoeForCausalLM.from_pretrained(tmp_path, experts_implementation=experts).eval().to("tpu")
    ids, mask = _batch()
    with torch.no_grad():
        expected = cpu(input_ids=ids, attention_mask=mask).logits
        got = dev(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu")).logits
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
