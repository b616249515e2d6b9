"""The tier runs against the wheel it was written for, with torch_tpu autoloaded as on a TPU VM."""

import sys

import torch


def test_torch_tpu_autoloaded(torch_tpu_version):
    assert torch_tpu_version == "0.2.0"
    assert "torch_tpu" in sys.modules, "the contract tier runs with TORCH_DEVICE_BACKEND_AUTOLOAD=1"
    assert hasattr(torch, "tpu")
