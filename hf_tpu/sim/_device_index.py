"""The index of a simulated tpu device, checked: one device per process (``tpu:0``), as torch_tpu gives.

Its own module so that the simulated ``torch.tpu`` module (:mod:`hf_tpu.sim._device_module`), whose public names
are the wheel's, keeps it private while the other modules of the simulator import it by a public name."""

from __future__ import annotations

from typing import Any

import torch


def index_of_device(device: Any) -> int:
    if device is None:
        return 0
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "tpu":
            raise ValueError(f"expected a tpu device, got {device}")
        idx = 0 if device.index is None else device.index
    else:
        idx = int(device)
    if idx != 0:
        raise RuntimeError(
            f"tpu:{idx} does not exist: the simulated TPU, like torch_tpu, gives each process one device (tpu:0)."
        )
    return idx
