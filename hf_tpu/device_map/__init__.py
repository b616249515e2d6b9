"""Place Hugging Face models on TPU chips with ``device_map``: enumeration, ``max_memory``, maps, checks.

After :func:`hf_tpu.enable`, ``from_pretrained(device_map=...)`` accepts ``"tpu"``, ``"tpu:0"``, ``0``, ``"auto"``,
``"balanced"``, ``"sequential"`` and dicts with ``"tpu:N"``/``"cpu"``/``"disk"`` values, with
``max_memory={"tpu": "14GiB", "cpu": "64GiB"}``; Accelerate's ``infer_auto_device_map``, ``dispatch_model`` and
``load_checkpoint_and_dispatch`` plan for and place on the TPU; pipelines take ``device="tpu"``. See
``docs/device_map.md``.

Example:
    >>> import hf_tpu                                                                    # doctest: +SKIP
    >>> hf_tpu.enable()                                                                  # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_pretrained(path, device_map="auto")            # doctest: +SKIP
    >>> model.hf_device_map                                                              # doctest: +SKIP
"""

from __future__ import annotations

from hf_tpu.device_map.devices import TPUMemory, is_tpu_device, tpu_available, tpu_device_count, tpu_memory
from hf_tpu.device_map.maps import normalize_device, normalize_device_map
from hf_tpu.device_map.memory import get_max_memory, normalize_max_memory
from hf_tpu.device_map.preflight import DeviceMapFitError, check_placement, format_bytes, placement_bytes
from hf_tpu.device_map.ties import retie, tied_groups

__all__ = [
    "DeviceMapFitError",
    "TPUMemory",
    "check_placement",
    "format_bytes",
    "get_max_memory",
    "is_tpu_device",
    "normalize_device",
    "normalize_device_map",
    "normalize_max_memory",
    "placement_bytes",
    "retie",
    "tied_groups",
    "tpu_available",
    "tpu_device_count",
    "tpu_memory",
]
