"""How many bytes a model's weights take on the device, quantized tensor subclasses counted by their parts.

``tensor.nbytes`` of a torchao tensor subclass reports the logical (float) size; the device holds its inner
tensors (``qdata``, ``scale``, ...). Tensors shared by several modules (tied weights) count once.
"""

from __future__ import annotations

from typing import Any

__all__ = ["tensor_bytes", "weight_bytes"]


def tensor_bytes(tensor: Any) -> int:
    """Bytes ``tensor`` holds: the sum of its inner tensors for a traceable subclass, else ``nbytes``."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.untyped_storage().nbytes() if tensor.numel() else 0


def weight_bytes(model: Any, device_type: str | None = None) -> int:
    """Bytes of ``model``'s parameters and buffers (on ``device_type`` only, when given).

    Args:
        model: a ``torch.nn.Module``; a tensor shared by several names counts once, and a quantized tensor
            subclass counts its inner tensors.
        device_type: count only tensors on this device type (``"tpu"``, ``"cpu"``); None (the default) counts all.

    Returns:
        The total in bytes.

    Example:
        >>> import torch
        >>> weight_bytes(torch.nn.Linear(4, 2, bias=False).to(torch.bfloat16))
        16
    """
    seen: set[int] = set()
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in seen or (device_type is not None and tensor.device.type != device_type):
            continue
        seen.add(id(tensor))
        total += tensor_bytes(tensor)
    return total
