"""Device memory one quantized Linear takes while a compiled graph runs it on the simulated tpu (op by op, as the
simulator counts): the dequantized weight is the only full-size float tensor made, so the peak above what was live
is at most 3 bytes per weight (the 1-byte integer values and the 2-byte bf16 weight they become) plus the output,
not 4 (two bf16 temporaries, from subtracting the zero point in the float dtype). At Llama-3's proportions this is
what keeps peak memory during generate within 10% of weights + cache (``hf-tpu bench quant --shape realistic``,
docs/quantization.md). The outputs equal the CPU running the same quantized weights."""

from __future__ import annotations

import pytest
import torch

import hf_tpu.sim

ROWS, COLUMNS = 1792, 512  # a Llama MLP's up projection at hidden 512 (intermediate 3.5x)


def _run(linear, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``linear(x)`` compiled for the tpu, and the device memory its warmed-up run took above what was live."""
    compiled = torch.compile(linear)
    out = compiled(x)
    live = hf_tpu.sim.memory_allocated()
    with hf_tpu.sim.stats() as s:
        out = compiled(x)
    return out, s.peak_bytes - live


def _int4(device: str):
    from hf_tpu.quantization.int4 import TpuInt4Tensor, quantize_int4

    q = quantize_int4(torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(0)).bfloat16(), 128)
    weight = TpuInt4Tensor(q.qdata.to(device), q.scale.to(device), q.zero_point.to(device), 128, q.shape)
    return lambda x: torch.nn.functional.linear(x, weight)


def _compressed(name: str):
    def make(device: str):
        pytest.importorskip("compressed_tensors")
        from compressed_tensors.compressors import compress_module

        from hf_tpu.quantization.compressed import _layout, dequantize_packed
        from hf_tpu.quantization.ct_checkpoint import quantize_in_memory, scheme

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(COLUMNS, ROWS, bias=False)).to(torch.bfloat16)
        quantize_in_memory(model, scheme(name))
        module = model[0]
        compress_module(module, "pack-quantized")
        module._hf_tpu_packed = _layout(module)
        module.to(device)
        return lambda x: torch.nn.functional.linear(x, dequantize_packed(module, x.dtype))

    return make


@pytest.mark.parametrize("make", [_int4, _compressed("w8a16"), _compressed("w4a16-asym")],
                         ids=["int4", "ct-w8a16", "ct-w4a16-asym"])
def test_a_quantized_linear_takes_at_most_3_bytes_per_weight_above_its_output(make):
    x = torch.randn(1, 4, COLUMNS, generator=torch.Generator().manual_seed(1)).bfloat16()
    out, excess = _run(make("tpu"), x.to("tpu"))
    torch.testing.assert_close(out.cpu(), make("cpu")(x))  # the CPU running the same quantized weights
    weights, out_bytes = ROWS * COLUMNS, out.numel() * out.element_size()
    assert 2 * weights <= excess <= 3 * weights + out_bytes, (excess, weights)  # the bf16 weight is made, once
