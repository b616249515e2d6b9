"""The ``peft`` integration: ``PeftModel.from_pretrained`` and ``load_adapter`` read an adapter for a TPU model.

Upstream state (peft 0.17 to 0.22, safetensors 0.8, checked on the simulated device):

- peft 0.22's ``infer_device`` asks ``torch.accelerator`` and answers ``tpu`` where torch_tpu is the current
  accelerator (0.21 answered ``cpu``). ``load_peft_weights`` then reads the adapter file with
  ``safetensors.torch.load_file(filename, device="tpu")``, which safetensors refuses ("device tpu is invalid": its
  device parser knows cuda, mps, xpu, npu, ... and no ``tpu``), so ``PeftModel.from_pretrained(tpu_model, path)``
  failed on every TPU model. The same holds for an explicit ``torch_device="tpu"`` on any peft version.
- hf_tpu wraps the two readers that ``peft.utils.save_and_load`` calls (its module's ``safe_load_file`` and
  ``torch_load`` names): a read bound for a TPU reads on the host and moves each tensor to that device, one copy per
  tensor, which is what safetensors does for the devices it knows. Every other device goes to upstream unchanged.

peft is imported by the user, often after :func:`hf_tpu.enable`: the integration waits for ``import peft``
(:data:`hf_tpu._patch.DEFERRED`) and costs nothing in a program that never imports it.
"""

from __future__ import annotations

import functools
from typing import Any

from hf_tpu import _patch
from hf_tpu.device_map.devices import is_tpu_device

FEATURE = "peft"
PEFT = {"package": "peft", "versions": ">=0.17,<0.23"}

__all__ = ["apply"]


def _to(tensors: dict, device: Any) -> dict:
    return {name: tensor.to(device) for name, tensor in tensors.items()}


def apply() -> None:
    """Apply the peft integration (called by :func:`hf_tpu.enable`, or when ``peft`` is imported after it)."""
    from peft.utils import save_and_load

    safe_load_file = _patch.original(save_and_load, "safe_load_file")
    torch_load = _patch.original(save_and_load, "torch_load")

    @functools.wraps(safe_load_file)
    def safe_load_file_for_tpu(filename, device="cpu", *args, **kwargs):
        if not is_tpu_device(device):
            return safe_load_file(filename, device, *args, **kwargs)
        return _to(safe_load_file(filename, "cpu", *args, **kwargs), device)

    @functools.wraps(torch_load)
    def torch_load_for_tpu(*args, map_location=None, **kwargs):
        if not is_tpu_device(map_location):
            return torch_load(*args, map_location=map_location, **kwargs)
        return _to(torch_load(*args, map_location="cpu", **kwargs), map_location)

    _patch.patch(save_and_load, "safe_load_file", safe_load_file_for_tpu, feature=FEATURE, **PEFT)
    _patch.patch(save_and_load, "torch_load", torch_load_for_tpu, feature=FEATURE, **PEFT)
