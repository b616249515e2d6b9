"""A kernel form is one spec plus one registration (issue #66): the :class:`~hf_tpu.kernels.forms.KernelForm` this file
declares is registered in the test, asked through the one lookup (:func:`~hf_tpu.kernels.forms.choose_form`) inside a
model's forward, and a compiled ``generate`` on the simulator runs the form it picks, token-identical to upstream's
``generate`` on the CPU; unregistered, the name is gone."""

from __future__ import annotations

import pytest
import torch

import hf_tpu.sim
from hf_tpu.errors import InvalidArgumentError
from hf_tpu.kernels.forms import KernelForm, choose_form, kernel_form, register_kernel_form, unregister_kernel_form

GREEDY = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
RAN = {"upstream": 0, "root": 0}


def _root_norm(module, hidden_states):
    """The RMS norm written another way (a square root, then a division): the form "root"."""
    RAN["root"] += 1
    dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return module.weight * x.to(dtype)


# The test's form: which RMS norm a Llama layer runs, picked by the hidden size (a fact of the call), no override.
TEST_FORM = KernelForm(
    "test_rms_norm", ("upstream", "root"), "a test's choice of RMS norm", unmeasured="a test's form, never measured",
    pick=lambda override, hidden: "root" if hidden % 2 == 0 else "upstream",
)  # fmt: skip


def test_a_kernel_form_registered_in_a_test_runs_in_a_compiled_generate_like_the_cpu(from_config, prompts,
                                                                                      monkeypatch):  # fmt: skip
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    cpu, tpu = from_config(LlamaForCausalLM, config)
    ids, mask = prompts([4, 9])
    want = cpu.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY)  # upstream's norm, on the CPU

    upstream_forward = modeling_llama.LlamaRMSNorm.forward

    def forward(self, hidden_states):  # the model's norm asks the registry, as hf_tpu's call sites do
        if choose_form("test_rms_norm", hidden=hidden_states.shape[-1]) == "root":
            return _root_norm(self, hidden_states)
        RAN["upstream"] += 1
        return upstream_forward(self, hidden_states)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)
    register_kernel_form(TEST_FORM)
    RAN.update(upstream=0, root=0)
    try:
        with pytest.raises(InvalidArgumentError, match="registered already"):
            register_kernel_form(TEST_FORM)
        with hf_tpu.sim.stats() as s:
            got = tpu.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY)
    finally:
        assert unregister_kernel_form("test_rms_norm") is TEST_FORM
    assert torch.equal(got.to("cpu"), want)
    assert s.compiles >= 2  # the call's prefill and decode graphs were compiled with the form in them
    assert RAN["root"] > 0 and RAN["upstream"] == 0, RAN  # hidden 32: the form the rule picks, and only it
    with pytest.raises(InvalidArgumentError, match="no kernel form 'test_rms_norm'"):
        kernel_form("test_rms_norm")
