"""The ``training`` self-test check passes on the simulated device and reports its compile figures."""

from hf_tpu import selftest


def test_training_check_passes_and_reports_no_compile_after_the_first_step():
    (result,) = selftest.run_checks(only=["training"])
    assert result.status == "passed", result.error
    f = result.figures
    assert f["max_loss_diff"] < 1e-4 and f["trainer_device"] == "tpu:0"
    assert f["warm_compiles_per_step"] == 0 and f["warm_shape_signatures_per_step"] == 0
