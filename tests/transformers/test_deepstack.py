"""Deepstack's early vision features added at the image tokens with static shapes (hf_tpu.transformers._deepstack):
the same values as upstream's boolean-mask index, bit for bit; applied by the image loop, reverted by disable."""

import pytest
import torch

import hf_tpu
import hf_tpu.sim
from hf_tpu import _patch
from hf_tpu.transformers import _deepstack

T = pytest.importorskip("transformers")
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_deepstack_equals_upstreams_bit_for_bit_and_reads_nothing_on_the_host(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 8, generator=g).to(dtype)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[0, 2:5], mask[1, [0, 6]] = True, True
    embeds = torch.randn(int(mask.sum()), 8, generator=g)
    upstream = _patch.original(Qwen3VLTextModel, "_deepstack_process")
    want = upstream(None, hidden, mask, embeds)
    got = _deepstack.static_deepstack(None, hidden, mask, embeds)
    assert got.dtype == want.dtype and torch.equal(got, want)
    # compiled for the device: no host read (upstream's mask index is one: torch_tpu refuses it, tests/contract)
    hf_tpu.enable()
    before = len(hf_tpu.sim.host_reads())
    fn = torch.compile(_deepstack.static_deepstack, backend="tpu", fullgraph=True)
    on_tpu = fn(None, hidden.to("tpu"), mask.to("tpu"), embeds.to("tpu"))
    assert hf_tpu.sim.host_reads()[before:] == [] and torch.equal(on_tpu.cpu(), want)
    # (upstream's: refused by the simulator as torch_tpu refuses it, and recorded)
    with pytest.raises(Exception, match=r"nonzero\(\): cannot record EventSnapshot during an FX trace"):
        torch.compile(upstream, backend="tpu", fullgraph=True)(None, hidden.to("tpu"), mask.to("tpu"),
                                                               embeds.to("tpu"))  # fmt: skip
    assert len(hf_tpu.sim.host_reads()) == before + 1


def test_the_image_loop_applies_it_to_the_defining_class_and_disable_reverts_it():
    config = T.Qwen3VLConfig(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e4}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                           num_position_embeddings=16, deepstack_visual_indexes=[0]),
    )  # fmt: skip
    model = T.Qwen3VLForConditionalGeneration(config)
    upstream = Qwen3VLTextModel.__dict__["_deepstack_process"]
    hf_tpu.enable()
    try:
        assert _deepstack.apply_to(model)
        assert Qwen3VLTextModel.__dict__["_deepstack_process"] is _deepstack.static_deepstack
        assert any(r.owner is Qwen3VLTextModel for r in _patch.applied("generation"))
        assert not _deepstack.apply_to(T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=16,
                                                                          intermediate_size=32, num_hidden_layers=1,
                                                                          num_attention_heads=2)))  # fmt: skip
        hf_tpu.disable("generation")
        assert Qwen3VLTextModel.__dict__["_deepstack_process"] is upstream
    finally:
        hf_tpu.enable("generation")
