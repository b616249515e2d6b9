"""compressed-tensors checkpoints (pack-quantized w8a16 and w4a16, as RedHatAI/neuralmagic models ship) made here with
the compressed-tensors library's own API (hf_tpu.quantization.ct_checkpoint), loaded on tpu through transformers'
compressed-tensors quantizer: the weights stay packed in device memory, dequantized per matmul inside the graph,
and the model generates equal to the CPU loading the same checkpoint (where compressed-tensors decompresses it on
the first forward)."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from conftest import MAX_PROMPT, NEW_TOKENS, Loaded, make_prompts

import hf_tpu
import hf_tpu.sim
from hf_tpu.quantization import weight_bytes

from hf_tpu.quantization.ct_checkpoint import PRESETS, quantize_in_memory, save_compressed, scheme

pytest.importorskip("compressed_tensors")

LIMIT = {"w8a16": 0.55, "w4a16": 0.35}  # of the bf16 weights' device memory (the embedding table stays bf16)


_CHECKPOINTS: dict[tuple[str, bool], object] = {}


@pytest.fixture
def compressed_checkpoint(checkpoint, tmp_path_factory):
    """``compressed_checkpoint(name, activations=False)``: the tiny Llama saved compressed with scheme ``name``."""

    def get(name: str, activations: bool = False):
        key = (name, activations)
        if key not in _CHECKPOINTS:
            path = tmp_path_factory.mktemp("compressed") / f"{name}{'-a8' if activations else ''}"
            save_compressed(checkpoint, path, name, activations)
            _CHECKPOINTS[key] = path
        return _CHECKPOINTS[key]

    return get


_MODELS: dict[str, tuple[Loaded, torch.nn.Module]] = {}


@pytest.fixture
def compressed(compressed_checkpoint):
    """``compressed(name) -> (Loaded on tpu, the CPU model)``: the same checkpoint loaded on both, once a session."""
    from transformers import AutoModelForCausalLM

    def get(name: str):
        if name not in _MODELS:
            path = compressed_checkpoint(name)
            before = hf_tpu.sim.memory_allocated()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                tpu = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="tpu").eval()
            assert not [w for w in caught if "cannot stay packed" in str(w.message)]  # kept packed
            loaded = Loaded(tpu, hf_tpu.sim.memory_allocated() - before)
            cpu = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
            _MODELS[name] = loaded, cpu
        return _MODELS[name]

    return get


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dequantize_packed_equals_compressed_tensors_decompress(name):
    """hf_tpu's in-graph dequantization against compressed-tensors' own decompression, on the CPU, for each
    weight layout it keeps packed (symmetric and asymmetric, per tensor, channel and group, 2/4/8 bits)."""
    from compressed_tensors.compressors import compress_module, decompress_module
    from compressed_tensors.quantization import QuantizationStatus

    from hf_tpu.quantization.compressed import _layout, _unsupported, dequantize_packed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 24, bias=False)).to(torch.bfloat16)
    quantize_in_memory(model, scheme(name))
    linear = model[0]
    compress_module(linear, "pack-quantized")
    assert linear.quantization_status == QuantizationStatus.COMPRESSED and _unsupported(linear) is None
    linear._hf_tpu_packed = _layout(linear)
    got = dequantize_packed(linear)
    decompress_module(linear)
    assert got.dtype == linear.weight.dtype and torch.equal(got, linear.weight)


@pytest.mark.parametrize("name", sorted(LIMIT))
def test_weights_stay_packed_in_device_memory_and_logits_equal_cpu(compressed, loaded, name):
    tpu, cpu = compressed(name)
    bf16 = loaded("bf16")
    assert tpu.weights == weight_bytes(tpu.model, "tpu")  # the counters saw the packed tensors, no float copy
    assert tpu.weights <= LIMIT[name] * bf16.weights, (name, tpu.weights, bf16.weights)
    ids, _ = make_prompts([12], seed=1)
    with torch.no_grad():
        got = tpu.model(input_ids=ids.to("tpu")).logits.cpu()
        want = cpu(input_ids=ids).logits  # compressed-tensors decompresses the CPU model here
        unquantized = bf16.model(input_ids=ids.to("tpu")).logits.cpu()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert not torch.allclose(got, unquantized, rtol=1e-2, atol=1e-2)  # the quantized weights are what ran
    from hf_tpu.quantization.compressed import dequantize_packed

    for layer, cpu_layer in zip(tpu.model.model.layers, cpu.model.layers, strict=True):
        down = layer.mlp.down_proj  # still packed after a forward; dequantizes to upstream's decompressed weight
        assert down.weight_packed.dtype == torch.int32 and down.weight_packed.device.type == "tpu"
        assert "weight" not in down._parameters
        assert torch.equal(dequantize_packed(down).cpu(), cpu_layer.mlp.down_proj.weight)


def test_warmup_then_greedy_generate_equals_cpu_and_compiles_nothing(compressed):
    """The compiled path (one model: compiles are what cost here; the w8a16 weights and forward are checked equal
    above, through the same code)."""
    loaded, cpu = compressed("w4a16")
    tpu = loaded.warmed()
    with hf_tpu.sim.stats() as s:
        for n in (1, 4, 7, 10, 13, MAX_PROMPT):
            ids, _ = make_prompts([n], seed=100 + n)
            got = tpu.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(got, cpu.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)), n
    assert s.compiles == 0
    assert "weight" not in tpu.model.layers[0].mlp.down_proj._parameters


def test_activation_quantization_keeps_upstreams_path_with_a_warning(compressed_checkpoint):
    """w8a8 (dynamic int8 activations) is not kept packed: the warning says so and why; upstream decompresses."""
    from transformers import AutoModelForCausalLM

    path = compressed_checkpoint("w8a16", activations=True)
    with pytest.warns(UserWarning, match="activation quantization cannot stay packed"):
        tpu = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="tpu").eval()
    assert not hasattr(tpu.model.layers[0].mlp.down_proj, "_hf_tpu_packed")


def test_auto_puts_the_whole_packed_model_on_a_chip_too_small_for_bf16(compressed_checkpoint, loaded):
    """device_map='auto' plans with the packed sizes: with free HBM below the bf16 weights (80%; the w4a16 ones are
    31%, the rest is room for a forward's activations and one dequantized matrix), the w4a16 checkpoint lands whole
    on the chip and stays packed."""
    from transformers import AutoModelForCausalLM

    bf16 = loaded("bf16").weights
    path = compressed_checkpoint("w4a16")
    gc.collect()
    hf_tpu.sim.enable(hbm=hf_tpu.sim.memory_allocated() + int(0.8 * bf16))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="auto").eval()
        assert getattr(model, "hf_device_map", {"": "tpu:0"}) == {"": "tpu:0"}
        assert {str(p.device) for p in model.parameters()} == {"tpu:0"}
        assert hasattr(model.model.layers[0].mlp.down_proj, "_hf_tpu_packed")
        ids, _ = make_prompts([5], seed=2)
        with torch.no_grad():
            model(input_ids=ids.to("tpu"))  # runs within the small chip: nothing is decompressed
        del model
        gc.collect()
    finally:
        hf_tpu.sim.enable()
