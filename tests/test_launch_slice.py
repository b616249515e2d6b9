"""A rank started in a launch environment that describes more devices than torchrun started processes (torch_tpu's
recipe, ``set_tpu_launch_env()`` without ``nproc_per_node``, then ``--nproc_per_node=2`` on a 4-chip host) is told
so by the simulator (issue 36; the wheel's side: tests/contract/test_launch.py)."""

from __future__ import annotations

import pytest

from hf_tpu import _autoload
from hf_tpu._launch_env import set_simulated_launch_env


def test_a_rank_of_two_in_a_four_device_slice_is_warned(monkeypatch):
    env = set_simulated_launch_env(nproc_per_node=4, env={})  # what the recipe's launcher sets on the simulator
    for name, value in {**env, "HF_TPU_SIMULATE": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.warns(UserWarning, match=r"describes 4 TPU devices .* started 2 process\(es\) here: call "
                                         r"torch.tpu.distributed.set_tpu_launch_env\(nproc_per_node=2\)"):
        _autoload.load()


def test_a_rank_of_a_matching_slice_is_not_warned(monkeypatch, recwarn):
    env = set_simulated_launch_env(nproc_per_node=4, env={})
    for name, value in {**env, "HF_TPU_SIMULATE": "1", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    _autoload.load()
    assert not [w for w in recwarn if "TPU devices" in str(w.message)]
