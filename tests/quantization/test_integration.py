"""The quantization integration is reversible: disable() puts torchao's int4 handler, transformers' torchao quantizer,
its fp8 Linear and its compressed-tensors quantizer back exactly."""

from __future__ import annotations

from hf_tpu import _patch
from hf_tpu.quantization import _integration


def test_revert_restores_torchao_and_transformers_exactly():
    from torchao.quantization import Int4WeightOnlyConfig
    from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER
    from transformers.integrations.finegrained_fp8 import FP8Linear
    from transformers.integrations.torchao import TorchAoQuantize
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer
    from transformers.quantizers.quantizer_torchao import TorchAoHfQuantizer

    _integration.install_torchao_handlers()
    wrapped = _QUANTIZE_CONFIG_HANDLER[Int4WeightOnlyConfig]
    upstream = wrapped.__hf_tpu_upstream__
    after_loading = "_process_model_after_weight_loading"
    assert CompressedTensorsHfQuantizer.__dict__[after_loading].__hf_tpu_upstream__
    assert TorchAoQuantize.__dict__["_quantize"].__hf_tpu_upstream__
    _patch.revert(_integration.FEATURE)
    try:
        assert _QUANTIZE_CONFIG_HANDLER[Int4WeightOnlyConfig] is upstream
        assert not hasattr(TorchAoQuantize.__dict__["_quantize"], "__hf_tpu_upstream__")
        assert not hasattr(TorchAoHfQuantizer.__dict__["validate_environment"], "__hf_tpu_upstream__")
        assert not hasattr(FP8Linear.__dict__["forward"], "__hf_tpu_upstream__")
        # inherited upstream (HfQuantizer's no-op): the attribute hf_tpu added is gone again
        assert after_loading not in CompressedTensorsHfQuantizer.__dict__
        assert CompressedTensorsHfQuantizer._process_model_after_weight_loading is getattr(HfQuantizer, after_loading)
    finally:
        _patch.enable(_integration.FEATURE)
    _integration.install_torchao_handlers()
    assert _QUANTIZE_CONFIG_HANDLER[Int4WeightOnlyConfig].__hf_tpu_upstream__ is upstream
