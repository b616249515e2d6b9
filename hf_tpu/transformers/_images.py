"""Image inputs of a vision-language ``generate`` (LLaVA, Gemma 3, ...): which a call has, whether hf_tpu's cached
loop can take them, and the vision tower run as its own compiled graph.

transformers 5.24's ``generate`` encodes the images of a model whose forward takes ``mm_encoder_outputs`` before its
first forward (``GenerationMixin._prepare_multimodal_encoder_kwargs_for_generation``: the base model's
``get_image_features`` on the call's pixel inputs), and the forward then merges those features into the prompt's
embeddings at the image tokens with its own code. hf_tpu does the same with the vision tower compiled: one
``("vision", ...)`` graph per image count and pixel shape (:func:`encode_images`, the features stay on the device),
and hands upstream the encoded images as ``mm_encoder_outputs``; its cached loop's prefill graph
(``"mm_prefill"``, keyed also by the features' shape) runs the model's forward on the left-padded prompt, image
tokens included (they count toward the prompt bucket), and the forward merges them; the decode steps are the text
loop's. Pixel inputs left on the host are moved to the device here.
"""

from __future__ import annotations

import inspect

__all__ = ["encode_images", "image_inputs", "images_problem"]

# the argument names upstream recognises as a modality's main input (generation/utils.py)
_PIXEL_NAMES = ("pixel_values", "pixel_values_images", "image_patches")


def _encoder_fn(model):
    return getattr(model.base_model, "get_image_features", None)


def image_inputs(model, model_kwargs: dict) -> list[str]:
    """The names of the call's inputs that upstream hands the image encoder (``get_image_features``'s arguments
    among ``model_kwargs``, given and not None); empty when the call has no pixel input."""
    fn = _encoder_fn(model)
    if fn is None or model.config.is_encoder_decoder:
        return []
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []
    names = [k for k in params if k != "kwargs" and model_kwargs.get(k) is not None]
    return names if any(k in _PIXEL_NAMES for k in names) else []


def images_problem(model, model_kwargs: dict) -> str | None:
    """Why hf_tpu's cached loop cannot take this call's images (None when it can)."""
    name = type(model).__name__
    if "image" not in getattr(model, "input_modalities", ()) or not model._supports_mm_encoder_outputs():
        return f"images: {name}'s forward takes no pre-encoded images (mm_encoder_outputs)"
    base = model.base_model
    if hasattr(base, "get_rope_index") or "rope_deltas" in inspect.signature(model.forward).parameters:
        return (
            f"images: {name} numbers its positions from the images (multimodal rotary positions, get_rope_index over "
            "the image grid), which the bucketed loop does not build yet"
        )
    video = [k for k in model_kwargs if "video" in k and model_kwargs[k] is not None]
    if video:
        return f"videos ({', '.join(video)}) are not supported by the bucketed loop yet"
    return None


def encode_images(model, state, model_kwargs: dict, run) -> dict:
    """``model_kwargs`` with its image inputs replaced by ``mm_encoder_outputs={"image": ...}``: the base model's
    ``get_image_features`` run as a compiled graph (``run``: :func:`hf_tpu.transformers._graphs._run`) on the
    inputs moved to the model's device, keyed by the shapes of its tensor inputs."""
    import torch

    names = image_inputs(model, model_kwargs)
    kwargs = dict(model_kwargs)
    inputs = {}
    for name in names:
        value = kwargs.pop(name)
        inputs[name] = value.to(model.device) if isinstance(value, torch.Tensor) else value
    shapes = tuple(
        (name, tuple(v.shape)) if isinstance(v, torch.Tensor) else (name, repr(v)) for name, v in inputs.items()
    )
    key = ("vision", int(next(v for k, v in inputs.items() if k in _PIXEL_NAMES).shape[0]), shapes)
    with torch.no_grad():
        encoded = run(model, state, key, inputs)
    kwargs["mm_encoder_outputs"] = {"image": encoded}
    return kwargs


def features_shape(mm_encoder_outputs) -> tuple:
    """The shapes of the encoded images' tensors (a prefill graph's key: the merge is compiled for them)."""
    import torch

    encoded = mm_encoder_outputs["image"]
    shapes = []
    for value in encoded.values() if hasattr(encoded, "values") else [encoded]:
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, torch.Tensor):
                shapes.append(tuple(t.shape))
    return tuple(shapes)
