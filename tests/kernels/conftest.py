"""Fixtures for the kernels tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def kernel():
    from hf_tpu.kernels import load_ragged_dot_kernel

    return load_ragged_dot_kernel()
