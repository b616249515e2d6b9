"""Weight-only int8 and int4 through ``TorchAoConfig`` on the simulated tpu device, against the CPU running the same
quantized weights: device memory, logits, greedy tokens, compiles after warm-up, peak memory during generate."""

from __future__ import annotations

import pytest
import torch
from conftest import LAYERS, MAX_PROMPT, NEW_TOKENS, inner_tensors, make_prompts

import hf_tpu
import hf_tpu.sim
from hf_tpu.quantization import weight_bytes

KINDS = ("int8", "int4")
# Device memory of the weights against bf16 (docs/quantization.md): int8 1 byte + a scale per row; int4 half a
# byte + a scale and a zero point per group of 128. The embedding table stays bf16 in both.
LIMIT = {"int8": 0.55, "int4": 0.35}
LAYOUT = {"int8": ("Int8Tensor", torch.int8), "int4": ("TpuInt4Tensor", torch.uint8)}
LENGTHS = (1, 3, 5, 7, 9, 11, 14, MAX_PROMPT)  # 8 prompt lengths over the warmed buckets


@pytest.mark.parametrize("kind", KINDS)
def test_weights_stay_quantized_in_device_memory(loaded, kind):
    bf16, quant = loaded("bf16"), loaded(kind)
    # the simulator's memory counters saw exactly what the weights hold: the quantized parts, no float copy
    assert bf16.weights == weight_bytes(bf16.model, "tpu")
    assert quant.weights == weight_bytes(quant.model, "tpu")
    assert quant.weights <= LIMIT[kind] * bf16.weights, (kind, quant.weights, bf16.weights)
    name, dtype = LAYOUT[kind]
    for layer in quant.model.model.layers:
        weight = layer.mlp.down_proj.weight
        assert type(weight).__name__ == name
        assert weight.qdata.device.type == "tpu" and weight.qdata.dtype == dtype


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_greedy_tokens_equal_cpu_with_the_same_weights(loaded, cpu_reference, kind):
    tpu, cpu = loaded(kind).warmed(), cpu_reference(kind)
    for (name, got), want in zip(tpu.named_parameters(), cpu.parameters(), strict=True):
        for part, tensor in inner_tensors(got).items():
            assert torch.equal(tensor.cpu(), inner_tensors(want)[part]), (name, part)
    ids, _ = make_prompts([12], seed=1)
    with torch.no_grad():
        got = tpu(input_ids=ids.to("tpu")).logits.cpu()
        want = cpu(input_ids=ids).logits
        unquantized = loaded("bf16").model(input_ids=ids.to("tpu")).logits.cpu()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert not torch.allclose(got, unquantized, rtol=1e-2, atol=1e-2)  # the quantized weights are what ran
    out = tpu.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(out, cpu.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False))


@pytest.mark.parametrize("kind", KINDS)
def test_warmup_then_8_prompt_lengths_compile_nothing_and_match_cpu(loaded, cpu_reference, kind):
    tpu, cpu = loaded(kind).warmed(), cpu_reference(kind)
    with hf_tpu.sim.stats() as s:
        for n in LENGTHS:
            ids, _ = make_prompts([n], seed=n)
            got = tpu.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            _equal_but_bf16_ties(got, cpu, ids, n)
    assert s.compiles == 0


def _equal_but_bf16_ties(got, cpu, ids, n):
    """Greedy tokens equal the CPU's; where they part, the CPU's bf16 logits of its token and of the TPU's are at most
    one bf16 step apart (a tie at the logits' precision: the dequantized matmul and CPU's int8 kernel round
    differently), and everything before it is equal."""
    ref = cpu.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True, return_dict_in_generate=True)
    if torch.equal(got, ref.sequences):
        return
    at = int((got[0] != ref.sequences[0]).nonzero()[0])
    assert torch.equal(got[0, :at], ref.sequences[0, :at]), n
    scores = ref.scores[at - ids.shape[1]][0]
    want, chosen = scores[ref.sequences[0, at]].float(), scores[got[0, at]].float()
    assert want - chosen <= want.abs() * 2**-7, (n, at, float(want), float(chosen))


def _transient_bytes(model) -> int:
    """Device memory a warmed-up generate takes above what was live before it (weights, static cache)."""
    ids, _ = make_prompts([11], seed=3)
    model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)  # the cache is allocated and kept
    live = hf_tpu.sim.memory_allocated()
    with hf_tpu.sim.stats() as s:
        model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return s.peak_bytes - live


@pytest.mark.parametrize("kind", KINDS)
def test_generate_makes_no_float_copy_of_the_weights(loaded, kind):
    bf16, quant = loaded("bf16"), loaded(kind)
    # The simulator runs a compiled graph op by op, so one Linear's weight is dequantized at a time (on a chip XLA
    # fuses it into the matmul). Allowed above bf16's activations: 3 bytes per weight of the largest matrix (its
    # 1-byte integer values and the bf16 weight they become; test_dequant_peak.py bounds each Linear).
    largest = max(p.numel() for p in bf16.model.parameters())
    extra = _transient_bytes(quant.warmed()) - _transient_bytes(bf16.warmed())
    assert extra <= 3 * largest, (kind, extra, largest)
    # ... far from a float copy of all the weights (LAYERS layers of 7 matrices)
    assert 3 * largest < bf16.weights / LAYERS
