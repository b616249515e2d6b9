"""hf_tpu.numerics: tolerances of a tpu result against the CPU's from the float32 matmul precision in force."""

import pytest
import torch

from hf_tpu import numerics
from hf_tpu.errors import HfTpuValueError


def test_tolerances_follow_the_precision_and_the_chips_figures():
    medium, high, highest = (numerics.float32_tolerance(p) for p in numerics.PRECISIONS)
    assert highest <= high < medium
    assert medium == pytest.approx(2 * numerics.CHIP_MATMUL_ERROR["medium"])
    assert numerics.float32_tolerance("medium", layers=3) == pytest.approx(3 * medium)
    with pytest.raises(HfTpuValueError, match="unknown float32 matmul precision 'low'"):
        numerics.float32_tolerance("low")
    with pytest.raises(HfTpuValueError, match="layers must be >= 1"):
        numerics.float32_tolerance("medium", layers=0)


def test_the_error_is_relative_to_the_outputs_scale():
    expected = torch.tensor([10.0, 0.0, -1e-6])
    actual = expected + torch.tensor([0.0, 1e-2, 1e-2])  # huge elementwise, 1e-3 of the scale
    assert numerics.max_error(actual, expected) == pytest.approx(1e-3)
    assert numerics.assert_close_to_cpu(actual, expected, precision="medium") == pytest.approx(1e-3)
    with pytest.raises(numerics.ToleranceError, match=r"at float32 matmul precision 'highest'.*chip's own"):
        numerics.assert_close_to_cpu(actual, expected, precision="highest", what="the logits")


def test_nan_integers_and_shapes_are_checked_exactly():
    with pytest.raises(numerics.ToleranceError, match="NaN or inf"):
        numerics.assert_close_to_cpu(torch.tensor([float("nan")]), torch.tensor([1.0]), precision="medium")
    with pytest.raises(numerics.ToleranceError, match="integer values differ"):
        numerics.assert_close_to_cpu(torch.tensor([1, 2]), torch.tensor([1, 3]))
    with pytest.raises(numerics.ToleranceError, match="shapes differ"):
        numerics.max_error(torch.zeros(2), torch.zeros(3))


def test_a_greedy_tie_is_proved_by_the_margin_not_assumed():
    logits = torch.tensor([8.0, 7.99, 1.0])  # bfloat16's eps at scale 8: 0.0625 -> two ulps 0.125
    tie, margin, allowed = numerics.greedy_tie(logits, chosen=1, expected=0)
    assert tie and margin == pytest.approx(0.01, rel=1e-4) and allowed == pytest.approx(0.125)
    tie, margin, _ = numerics.greedy_tie(logits, chosen=2, expected=0)
    assert not tie and margin == pytest.approx(7.0)
    assert not numerics.greedy_tie(logits, chosen=1, expected=0, dtype=torch.float32)[0]  # float32: a real miss


def test_matmul_precision_reads_the_setting_in_force():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert numerics.matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
