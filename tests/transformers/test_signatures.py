"""The names hf_tpu passes upstream's cache by come from the installed transformers (5.23: ``past_key_values``, 5.24+:
``cache``), never assumed: under either, a tiny Llama runs the static-cache loop (``prefill``/``decode``, not the loop
without a cache), token-identical to the CPU. ``.ci/run`` runs this file under the oldest supported transformers."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from packaging.version import Version

from hf_tpu.transformers import _upstream, explain, generation
from hf_tpu.transformers.route import writes_no_cache


def test_the_cache_name_is_the_one_the_installed_forward_takes():
    forward = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    expected = "cache" if Version(transformers.__version__) >= Version("5.24.0.dev0") else "past_key_values"
    assert expected in forward
    assert _upstream.cache_name() == expected
    assert _upstream.output_cache_field(transformers.generation.utils.GenerateDecoderOnlyOutput) == expected
    assert _upstream.output_cache_field(transformers.modeling_outputs.CausalLMOutputWithPast) == expected


def test_a_tiny_llama_runs_the_static_cache_loop_like_cpu(prompts, from_config):
    from hf_tpu.testing import tiny_config

    cpu, tpu = from_config(transformers.LlamaForCausalLM, tiny_config("llama", vocab_size=96))
    ids, mask = prompts([3, 9])
    expected = cpu.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    got = tpu.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, expected)
    assert {key[0] for key in generation.compiled_graphs(tpu)} == {"prefill", "decode"}  # not cacheless_*


def test_a_signature_that_does_not_tell_fails_loudly(monkeypatch):
    from transformers.generation.utils import GenerationMixin

    def neither(self, input_ids, attention_mask=None, **kwargs):
        return {}

    monkeypatch.setattr(_upstream, "_NAME", None)
    monkeypatch.setattr(GenerationMixin, "prepare_inputs_for_generation", neither)
    with pytest.raises(_upstream.UpstreamSignatureError, match="neither 'cache' nor 'past_key_values'"):
        _upstream.cache_name()

    def both(self, input_ids, cache=None, past_key_values=None, **kwargs):
        return {}

    monkeypatch.setattr(GenerationMixin, "prepare_inputs_for_generation", both)
    with pytest.raises(_upstream.UpstreamSignatureError, match="takes both"):
        _upstream.cache_name()
    with pytest.raises(_upstream.UpstreamSignatureError, match="no field named"):
        _upstream.output_cache_field(transformers.modeling_outputs.BaseModelOutput)


def test_a_forward_naming_its_cache_otherwise_is_named_not_run_without_a_cache(from_config):
    # A model class written for the other transformers version: its forward swallows the installed name in
    # **kwargs, so the probe would find "writes no cache"; the cached loop names the mismatch instead.
    other = [n for n in _upstream.CACHE_NAMES if n != _upstream.cache_name()][0]
    base = transformers.LlamaForCausalLM

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        kwargs.pop(_upstream.cache_name(), None)
        return base.forward(self, input_ids, attention_mask, position_ids, inputs_embeds=inputs_embeds, **kwargs)

    forward.__signature__ = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in ("input_ids", other)]
        + [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
    )
    other_llama = type("OtherVersionLlama", (base,), {"forward": forward})
    from hf_tpu.testing import tiny_config

    _, tpu = from_config(other_llama, tiny_config("llama", vocab_size=96))
    assert not writes_no_cache(tpu)
    assert f"takes its cache as {other!r}" in explain(tpu).reason
