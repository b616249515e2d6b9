"""The ``quantization`` self-test check passes on the simulated device and reports the weight ratios."""

from hf_tpu import selftest


def test_quantization_check_passes_with_quantized_weight_ratios():
    (result,) = selftest.run_checks(only=["quantization"])
    assert result.status == "passed", result.error
    f = result.figures
    assert f["int8_weights_vs_bf16"] <= 0.6 and f["int4_weights_vs_bf16"] <= 0.4
    assert f["int8_warmup_compiles"] >= 1 and f["int4_warmup_compiles"] >= 1
