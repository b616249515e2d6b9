"""hf_tpu.transformers._cache.static.apply_padding_mask: transformers' sdpa mask with a 2D padding mask on a tpu
device, built as a broadcast slice instead of a gather, equals upstream's mask on the CPU element for element."""

from __future__ import annotations

import pytest
import torch
from transformers import masking_utils

import hf_tpu

FUNCTIONS = {  # name -> (batch, device) -> mask function
    "causal": lambda batch, device: masking_utils.causal_mask_function,
    "sliding-3": lambda batch, device: masking_utils.sliding_window_causal_mask_function(3),
    "chunked-4": lambda batch, device: masking_utils.chunked_causal_mask_function(
        4, torch.arange(batch, device=device) % 2
    ),  # (left padding per row)
    "bidirectional": lambda batch, device: masking_utils.bidirectional_mask_function,
}
# (batch, q_length, kv_length, q_offset, kv_offset, padding mask length): a decode step over a static cache, a
# prefill, a kv_offset with the mask shorter than offset + length (upstream pads it), a mask longer than the cache
SHAPES = [(3, 1, 10, 7, 0, 10), (2, 4, 12, 0, 0, 9), (4, 1, 16, 5, 2, 18), (1, 5, 5, 0, 0, 5), (2, 3, 6, 2, 0, 11)]


def _upstream():
    sdpa_mask = masking_utils.sdpa_mask
    return getattr(sdpa_mask, "__hf_tpu_upstream__", sdpa_mask)


@pytest.mark.parametrize("name", list(FUNCTIONS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("causal_skip", [True, False])
def test_the_tpu_mask_equals_upstreams_on_cpu(name, shape, causal_skip):
    batch, q_length, kv_length, q_offset, kv_offset, length = shape
    mask_2d = torch.rand(batch, length, generator=torch.Generator().manual_seed(sum(shape))) > 0.3
    mask_2d[:, 0] = True
    cpu, tpu = FUNCTIONS[name](batch, "cpu"), FUNCTIONS[name](batch, "tpu")
    offsets = dict(q_offset=q_offset, kv_offset=kv_offset)
    expected = _upstream()(batch, q_length, kv_length, attention_mask=mask_2d, mask_function=cpu,
                           allow_is_causal_skip=causal_skip, **offsets)  # fmt: skip
    interface = masking_utils.AttentionMaskInterface._global_mapping["sdpa"]  # (enabled by the folder's conftest)
    assert interface is masking_utils.sdpa_mask is not _upstream()
    got = interface(batch, q_length, kv_length, attention_mask=mask_2d.to("tpu"), mask_function=tpu,
                    allow_is_causal_skip=causal_skip, device="tpu", **offsets)  # fmt: skip
    # the eager attention's float mask goes through the module's sdpa_mask too
    eager = masking_utils.eager_mask(batch, q_length, kv_length, attention_mask=mask_2d.to("tpu"), mask_function=tpu,
                                     device="tpu", **offsets)  # fmt: skip
    expected_eager = masking_utils.eager_mask(batch, q_length, kv_length, attention_mask=mask_2d, mask_function=cpu,
                                              **offsets)  # fmt: skip
    assert (got is None) == (expected is None)
    if expected is not None:
        assert got.device.type == "tpu" and got.dtype == torch.bool and got.shape == expected.shape
        assert torch.equal(got.cpu(), expected)
    assert torch.equal(eager.cpu(), expected_eager)


def test_other_masks_go_to_upstream_and_disable_puts_it_back():
    upstream = _upstream()
    # (tests/transformers/conftest.py keeps the generation integration enabled for the module)
    # a mask on the CPU and a vmap'd mask function are upstream's own calls
    padded = torch.tensor([[False, True, True, True, True, True], [True] * 6])
    for mask, device, vmap in [(padded, "cpu", False), (padded, "tpu", True)]:
        got = masking_utils.sdpa_mask(2, 1, 6, q_offset=5, attention_mask=mask.to(device), use_vmap=vmap,
                                      device=device)  # fmt: skip
        expected = upstream(2, 1, 6, q_offset=5, attention_mask=mask, use_vmap=vmap)
        assert got is not None and torch.equal(got.cpu(), expected)
    hf_tpu.disable("generation")
    try:
        assert masking_utils.sdpa_mask is upstream
        assert masking_utils.AttentionMaskInterface._global_mapping["sdpa"] is upstream
    finally:
        hf_tpu.enable("generation")
    assert masking_utils.sdpa_mask.__hf_tpu_upstream__ is upstream
    assert masking_utils.AttentionMaskInterface._global_mapping["sdpa"] is masking_utils.sdpa_mask
