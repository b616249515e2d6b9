"""Save and resume a plain training loop: weights, optimizer, scheduler and RNG state, all in safetensors.

``Trainer`` checkpoints itself (``save_steps`` / ``resume_from_checkpoint``); this is the same for a hand-written
loop. Everything is copied to the host before writing (safetensors cannot write a ``tpu`` tensor) and moved back to
the parameters' device on load, so a run can be resumed on another host, on CPU or on a TPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hf_tpu.errors import InvalidArgumentError, InvalidTypeError, MissingFileError

__all__ = ["load_checkpoint", "save_checkpoint"]

MODEL_FILE = "model.safetensors"
STATE_FILE = "training_state.safetensors"


def _split_state(prefix: str, obj: Any, tensors: dict, meta: Any = None) -> Any:
    """Replace every tensor in a nested state dict by a reference into ``tensors``; returns the JSON-able rest."""
    import torch

    if isinstance(obj, torch.Tensor):
        key = f"{prefix}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {"__dict__": [[_split_state(f"{prefix}.k{i}", k, tensors), _split_state(f"{prefix}.{i}", v, tensors)]
                             for i, (k, v) in enumerate(obj.items())]}  # fmt: skip
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_split_state(f"{prefix}.{i}", v, tensors) for i, v in enumerate(obj)],
                "tuple": isinstance(obj, tuple)}  # fmt: skip
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise InvalidTypeError(f"cannot store a {type(obj).__name__} in a safetensors checkpoint (at {prefix})")


def _join_state(obj: Any, tensors: dict) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {_join_state(k, tensors): _join_state(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            items = [_join_state(v, tensors) for v in obj["__list__"]]
            return tuple(items) if obj.get("tuple") else items
    return obj


def save_checkpoint(
    path: str | Path, model: Any, optimizer: Any = None, scheduler: Any = None, *, step: int = 0, **extra: Any
) -> Path:
    """Write ``model`` (``save_pretrained`` for a transformers model, else ``model.safetensors``) and the training
    state (optimizer, scheduler, step, torch's CPU RNG, ``extra`` JSON values) under the directory ``path``.

    Args:
        path: the checkpoint directory (created if needed).
        model: the model; its weights are read from wherever they live (TPU or CPU).
        optimizer: an optimizer whose ``state_dict`` is saved; None (the default) saves none.
        scheduler: a learning-rate scheduler whose ``state_dict`` is saved; None (the default) saves none.
        step: the training step to record; 0 by default.
        **extra: further JSON-serializable values, returned by :func:`load_checkpoint`.

    Returns:
        The checkpoint directory as a ``Path``.

    Example:
        >>> save_checkpoint("ckpt/step-100", model, optimizer, scheduler, step=100)   # doctest: +SKIP
    """
    import torch
    from safetensors.torch import save_file, save_model

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(out)
    else:
        save_model(model, str(out / MODEL_FILE))
    state = {
        "step": step,
        "extra": extra,
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng_cpu": torch.get_rng_state(),
    }
    tensors: dict[str, torch.Tensor] = {}
    layout = _split_state("state", state, tensors)
    save_file(tensors, str(out / STATE_FILE), metadata={"layout": json.dumps(layout)})
    return out


def load_checkpoint(
    path: str | Path, model: Any, optimizer: Any = None, scheduler: Any = None, *, strict: bool = True
) -> dict[str, Any]:
    """Load what :func:`save_checkpoint` wrote into ``model`` (in place, on its current device), ``optimizer``
    and ``scheduler``; restore torch's CPU RNG; return ``{"step": ..., **extra}``.

    Args:
        path: a directory :func:`save_checkpoint` wrote.
        model: the model to load the weights into, in place, on its current device.
        optimizer: an optimizer to restore (built over the model's parameters); None (the default) skips it.
        scheduler: a scheduler to restore when the checkpoint has one; None (the default) skips it.
        strict: passed to safetensors' ``load_model``: missing or unexpected weights raise; True by default.

    Returns:
        ``{"step": ..., **extra}`` as saved.

    Raises:
        FileNotFoundError (MissingFileError): ``path`` lacks the training state or ``model.safetensors`` file.
        ValueError (InvalidArgumentError): an optimizer is given but the checkpoint was saved without one.

    Example:
        >>> info = load_checkpoint("ckpt/step-100", model, optimizer, scheduler)   # doctest: +SKIP
        >>> start = info["step"]
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, load_model

    src = Path(path)
    state_file = src / STATE_FILE
    if not state_file.is_file():
        raise MissingFileError(f"{state_file} does not exist: {src} is not a checkpoint written by save_checkpoint")
    if (src / MODEL_FILE).is_file():
        # Read on the host (safetensors does not open files on tpu), then copy into the parameters in place.
        load_model(model, str(src / MODEL_FILE), strict=strict, device="cpu")
    else:
        raise MissingFileError(f"no {MODEL_FILE} in {src}")
    with safe_open(str(state_file), framework="pt") as f:
        layout = json.loads(f.metadata()["layout"])
    state = _join_state(layout, load_file(str(state_file), device="cpu"))
    if optimizer is not None:
        if state["optimizer"] is None:
            raise InvalidArgumentError(f"{src} holds no optimizer state (it was saved without an optimizer)")
        optimizer.load_state_dict(state["optimizer"])  # torch moves the state to each parameter's device
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng_cpu"])
    return {"step": state["step"], **state["extra"]}
