"""Benchmark: does each image-text-to-text architecture of the installed transformers generate well on a TPU (the
simulator)?

For every model type of ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``, a tiny random model is built from its config
class, shrunk by the causal-LM sweep's rules (:func:`hf_tpu.benchmarks._tiny_configs.tiny_config`; special-token ids
past the shrunk vocabulary moved into it; the vision fields linked to the shrunk text made consistent with it:
``_consistent``), one copy on the CPU and one on the simulated ``tpu`` after ``hf_tpu.enable()``. The images are what
the model's processor returns for images of its own vision size: ``pixel_values`` of shape
``(images, channels, image_size, image_size)``; Qwen-VL's patch rows with ``image_grid_thw`` (2 x 2 merged patches);
with ``image_sizes`` where the encoder takes them (LLaVA-NeXT's tiles of the vision size, one of the whole image
first, ``(images, tiles, channels, size, size)``; Mistral 3's image of 4 x 4 merged patches); Idefics2's and
Idefics3's unsplit images per text row, ``(1, images, channels, size, size)``, with ``pixel_attention_mask``;
Gemma 4's patch rows with their positions (``image_position_ids``), padded to 70 tokens' rows, with
``mm_token_type_ids`` (tests/transformers/test_vlm_sweep.py compares them with the families' own image processors).
A vision tower the config's defaults leave out (Gemma 4's) is built from its config class's shrunk defaults. The prompt holds as
many image tokens as the model's ``get_image_features`` gives features (run once on the CPU). Greedy ``generate``
runs three calls against the CPU's: one image after five text tokens, two images, another image after nine text
tokens. Per architecture:

- *route*: the loop the calls take, from :func:`hf_tpu.transformers.explain` (with its reason when not hf_tpu's);
- *identical*: the three generations token-identical to the CPU's;
- *compiles* and *new signatures*: the most of the two later calls (another image count, another image and prompt
  length), after ``hf_tpu.warmup(image_sizes=[...], num_images=[1, 2])`` on hf_tpu's loop (upstream's loop: after
  the first call, eagerly);
- *copies per step*: host->device and device->host copies per decode step (the third call and a 2-token run of its
  prompt, differenced).

Targets (:func:`hf_tpu.benchmarks.arch_sweep.misses`, the causal-LM sweep's): hf_tpu's loop, identical, 0 compiles,
<= 4 new signatures, <= 1 copy each way per step.

An architecture whose inputs the builder cannot make (no ``get_image_features``, a pixel layout or encoder arguments
other than those above, no image token) is a row saying so, counted apart from the buildable ones.
Workers, timeouts and ``--rows``/``--resume`` are the causal-LM sweep's (:mod:`hf_tpu.benchmarks.arch_sweep`).
``--write-docs`` writes the table into docs/architectures.md (its section after the causal-LM table). Run::

    hf-tpu bench vlm_sweep                              # every architecture
    hf-tpu bench vlm_sweep --archs llava gemma3         # some of them
    python benchmarks/vlm_sweep.py --rows /tmp/vlm.jsonl --resume --write-docs

An unknown architecture on its command line ends it with ``SystemExit`` and the message, as argparse does. A model
the generic inputs do not fit raises the built-in ``LookupError``, caught in the same function: its verdict row
names the exception's type (``LookupError: its vision config names no image_size`` in docs/architectures.md), so the
type is part of the rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from hf_tpu.benchmarks import arch_sweep
from hf_tpu.benchmarks._tiny_configs import SHRINK, VOCAB, _shrunk, tiny_config

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

__all__ = ["QUICK", "SECTION", "add_arguments", "architectures", "measure", "print_table", "rows_from_docs", "run",
           "tiny_vlm_config"]  # fmt: skip

QUICK = {"archs": ["llava", "gemma3", "paligemma", "qwen2_vl"], "new_tokens": 6}
# The docs page's section this sweep writes (from this line to the end of docs/architectures.md; the causal-LM
# sweep keeps it when it rewrites the page above it).
SECTION = arch_sweep.VLM_SECTION
TARGET_SHARE = arch_sweep.TARGET_SHARE
_NO_INPUTS = "no generic inputs"
_UNBUILT = ("not buildable", "fails on CPU", "not measured", _NO_INPUTS)

# its targets compare float32 results with the CPU's exactly: run at float32 matmul precision 'highest'
EXACT_FLOAT32 = True


def architectures() -> list[str]:
    """The model types with an image-text-to-text class in the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def tiny_vlm_config(model_type: str) -> Any:
    """The architecture's tiny config: :func:`~hf_tpu.benchmarks._tiny_configs.tiny_config`, its special-token ids
    moved into the shrunk vocabulary and its vision tower made consistent with the shrunk text."""
    config = tiny_config(model_type)
    _vision_tower(config)
    _small_token_ids(config)
    _consistent(config)
    return config


def _vision_tower(config: Any) -> None:
    """A vision tower the defaults leave out (Gemma 4's optional ``vision_config``, None by default: a checkpoint
    sets it): its config class's defaults, shrunk by the same rules, so that the model has images to take."""
    spec = getattr(type(config), "sub_configs", {}).get("vision_config")
    if spec is None or getattr(config, "vision_config", None) is not None:
        return
    cls = getattr(spec, "config_class", spec)
    config.vision_config = cls(**_shrunk(cls().to_dict()))


def _small_token_ids(config: Any) -> None:
    """Special-token ids past the shrunk vocabulary (an image token at 32000) moved to ids under it, each its own."""
    free = iter(range(VOCAB - 4, 3, -1))
    for name in sorted(vars(config)):
        value = getattr(config, name)
        if (name.endswith("_token_id") or name.endswith("_token_index")) and isinstance(value, int) and value >= VOCAB:
            setattr(config, name, next(free))


# The multimodal rotary sections a modeling file uses where the config leaves them unset (by model-type part)
_MROPE_SECTIONS = {"qwen": [16, 24, 24], "ernie4_5_vl": [22, 22, 20]}


def _consistent(config: Any) -> None:
    """Fields the shrunk vision tower must agree with: Gemma 3's image tokens pool the patch grid (``(patches per
    side / tokens per side)`` must be a whole kernel), so at its shrunk default size 224/16: 7 x 7 tokens; a
    projector into the text's embeddings (PaliGemma's ``projection_dim``, its defaults' text width) outputs the
    shrunk text width, as does a vision tower's ``out_hidden_size``; a tower sized by ``embed_dim`` and ``depth``
    (Qwen2-VL's) gets the shrunk width and depth; multimodal rotary sections split the shrunk head's rotary half."""
    text = config.get_text_config(decoder=True)
    default_width = getattr(type(config)().get_text_config(decoder=True), "hidden_size", None)
    for holder in (config, getattr(config, "vision_config", None)):
        if default_width and getattr(holder, "projection_dim", None) == default_width:
            # left at 2048, a 224/16 image's 196 features became 6272 "tokens" of the shrunk 64-wide text
            holder.projection_dim = text.hidden_size
    if (getattr(text, "vocab_size_per_layer_input", 0) or 0) > text.vocab_size:
        # per-layer input embeddings (Gemma 3n's, Gemma 4's) of their own vocabulary, the full one by default (a
        # 262144-row table, 1 GB a copy): the shrunk vocabulary's (the text's ids are all under it)
        text.vocab_size_per_layer_input = text.vocab_size
    vision = getattr(config, "vision_config", None)
    dims = ("mm_embed_dim", "output_proj_dims")
    if all(isinstance(getattr(vision, k, None), int) for k in dims):
        # Gemma 4 Unified's patch embedder, as wide as the text it writes into (3840 by default, a name no shrink
        # rule follows): the shrunk text width
        for k in dims:
            setattr(vision, k, text.hidden_size)
    ratio = getattr(vision, "pixel_shuffle_ratio", None)
    if isinstance(ratio, float) and isinstance(getattr(vision, "projector_input_dim", None), int):
        # Llama 4's vision adapter: a pixel shuffle folds 1/ratio^2 patches into one token of hidden/ratio^2 channels,
        # which its MLP takes as intermediate_size (its checkpoints: 1408 / 0.25 = 5632), projects to
        # projector_input_dim, then from projector_output_dim to the projector's vision_output_dim (all 4096 in its
        # checkpoints; 7680 by default): the shrunk width folded, then the text's width
        vision.intermediate_size = round(vision.hidden_size / ratio**2)
        for k in ("projector_input_dim", "projector_output_dim", "vision_output_dim"):
            setattr(vision, k, text.hidden_size)
    rope = getattr(text, "rope_parameters", None)
    # multimodal rotary sections (Qwen-VL, ERNIE-VL, GLM-4V): a split of the rotary half (its modeling file's
    # default when unset), scaled to the shrunk head's rotary half (its partial rotary share of it)
    unset = _mrope_default(config) or next((v for k, v in _MROPE_SECTIONS.items() if k in config.model_type), None)
    sections = rope.get("mrope_section", unset) if isinstance(rope, dict) else None
    half = int(_head_dim(text) * (rope.get("partial_rotary_factor") or 1.0)) // 2 if sections else 0
    if isinstance(sections, list) and sections and sum(sections) != half:
        scaled = [max(1, sections[i] * half // sum(sections)) for i in range(len(sections) - 1)]
        rope["mrope_section"] = [*scaled, max(0, half - sum(scaled))]
    vision = getattr(config, "vision_config", None)
    out = getattr(vision, "out_hidden_size", None)
    if isinstance(out, int) and out != text.hidden_size and text.hidden_size == SHRINK["hidden_size"]:
        # the vision tower's merger writes its features into the text's embeddings (Qwen3.5's 3584, GLM-5's 1536 by
        # default, past any default width the shrink rules follow): the shrunk text width (a text left at its
        # defaults' size is not followed up)
        vision.out_hidden_size = text.hidden_size
    embed = getattr(vision, "embed_dim", None)
    if isinstance(embed, int) and isinstance(getattr(vision, "depth", None), int) and embed > text.hidden_size and (
        text.hidden_size == SHRINK["hidden_size"]
    ):  # fmt: skip
        # a tower sized by embed_dim and depth (its hidden_size: the merger's output, the text's width), names the
        # shrink rules do not cover: Qwen2-VL's stayed 32 layers 1280 wide, 658M parameters (6 GB and minutes per
        # row): the shrunk width and depth
        vision.embed_dim, vision.depth = SHRINK["hidden_size"], SHRINK["num_hidden_layers"]
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    size = getattr(vision, "image_size", None)
    if pinpoints and isinstance(size, int):
        # LLaVA-NeXT's resolutions, multiples of its tile (the vision size: 336 by default, its checkpoints' CLIP) in
        # pixels: the same multiples of the shrunk vision size (CLIP's default, 224), as its processor tiles by it
        import math

        unit = math.gcd(*(int(n) for pair in pinpoints for n in pair))
        if unit != size:
            config.image_grid_pinpoints = [[int(n) // unit * size for n in pair] for pair in pinpoints]
    scale, patch = getattr(config, "scale_factor", None), getattr(vision, "patch_size", None)
    if isinstance(scale, int) and isinstance(size, int) and isinstance(patch, int) and (size // patch) % scale:
        # Idefics3's and SmolVLM's connector folds scale x scale patches into one token: their vision defaults (224
        # pixels of 32) leave 7 patches a side, which no checkpoint has (Idefics3's: 364 of 14, 26 a side): the
        # largest size under it whose side is a whole number of folds
        vision.image_size = max(1, size // (patch * scale)) * patch * scale
    tokens = getattr(config, "mm_tokens_per_image", None)
    size = getattr(vision, "image_size", None)
    if isinstance(tokens, int) and isinstance(size, int) and isinstance(patch, int):
        side = size // patch
        if side % max(int(tokens**0.5), 1) or int(tokens**0.5) > side:
            per_side = next(d for d in range(min(int(tokens**0.5), side), 0, -1) if side % d == 0 and d < side)
            config.mm_tokens_per_image = per_side * per_side


def _head_dim(text: Any) -> int:
    """The text's attention head width; a heterogeneous config's (Gemma 4's, whose global ``head_dim`` is ambiguous:
    upstream raises on reading it) from its first layer's config."""
    layer = text.per_layer_config[0] if getattr(text, "is_heterogeneous", False) else text
    return getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads


def _mrope_default(config: Any) -> list[int] | None:
    """The multimodal rotary sections the model's rotary embedding uses when its config sets none: the default its
    modeling file passes to ``rope_parameters.get("mrope_section", ...)`` (None where it has none)."""
    import ast
    import inspect
    import re
    import sys

    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(config), None)
    module = sys.modules.get(cls.__module__) if cls is not None else None
    found = re.search(r'get\("mrope_section", (\[[\d, ]+\])\)', inspect.getsource(module)) if module else None
    return list(ast.literal_eval(found.group(1))) if found else None


def _grid_images(vision: Any, count: int, seed: int) -> dict:
    """Qwen-VL's processor output: each image's patches flattened (``temporal_patch_size`` frames of
    ``patch_size``-square patches per row) and its ``image_grid_thw`` (one frame, 2 x 2 merged patches)."""
    import torch

    channels = int(getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3) or 3)
    # (a tower of still images, Dots3Note's: one frame a patch, no temporal_patch_size)
    width = channels * int(getattr(vision, "temporal_patch_size", 1)) * vision.patch_size**2
    g = torch.Generator().manual_seed(seed)
    side = 2 * vision.spatial_merge_size
    return {
        "pixel_values": torch.randn(count * side * side, width, generator=g),
        "image_grid_thw": torch.tensor([[1, side, side]] * count),
    }


def _images(config: Any, count: int, seed: int) -> tuple[dict, int | None]:
    """The image inputs of ``count`` images and their pixel size (None for Qwen-VL's patch layout)."""
    vision = getattr(config, "vision_config", None)
    grid = hasattr(vision, "temporal_patch_size") or "image_grid_thw" in _encoder_arguments(config)
    if hasattr(vision, "spatial_merge_size") and grid:  # (2 merged sides)
        return _grid_images(vision, count, seed), 2 * vision.spatial_merge_size * vision.patch_size
    if "image_sizes" in _encoder_arguments(config):
        return _sized_images(config, count, seed)
    if "image_position_ids" in _encoder_arguments(config, required=False):
        return _positioned_patches(vision, count, seed)
    if "pixel_attention_mask" in _encoder_arguments(config, required=False):
        return _masked_images(config, count, seed)
    pixels, size = _pixels(config, count, seed)
    return {"pixel_values": pixels}, size


# Gemma 4's image processor: the fewest soft tokens an image may be given (its max_soft_tokens choices' least), so
# the fewest patch rows every image is padded to (times the pooling kernel's area)
_GEMMA4_SOFT_TOKENS = 70


def _positioned_patches(vision: Any, count: int, seed: int) -> tuple[dict, int]:
    """Gemma 4's processor output (``max_soft_tokens=70``) for ``count`` square images: each resized to the most
    whole pooling kernels (``pooling_kernel_size`` patches a side) that fit its 70 soft tokens, 8 x 8 of them; its
    patch rows (``patch_size``-square patches of its pixels in [0, 1], row after row) padded with zero rows to 70
    kernels' patches, ``(images, patches, 3 * patch**2)``, and each row's (x, y) patch position, (-1, -1) for the
    padding (``image_position_ids``, ``(images, patches, 2)``). Gemma 4 Unified's processor merges each kernel into
    one row (no pooling in the model): 8 x 8 rows of 70."""
    import math

    import torch

    kernel, patch = int(vision.pooling_kernel_size), int(vision.patch_size)
    if hasattr(vision, "model_patch_size"):  # (Gemma 4 Unified: a row per merged patch, one token each)
        kernel, patch = 1, int(vision.model_patch_size)
    side = math.isqrt(_GEMMA4_SOFT_TOKENS) * kernel  # patches a side
    rows = _GEMMA4_SOFT_TOKENS * kernel * kernel
    g = torch.Generator().manual_seed(seed)
    pixels = torch.zeros(count, rows, 3 * patch * patch)
    pixels[:, : side * side] = torch.rand(count, side * side, 3 * patch * patch, generator=g)
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    positions = torch.full((count, rows, 2), -1, dtype=torch.long)
    positions[:, : side * side] = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
    return {"pixel_values": pixels, "image_position_ids": positions}, side * patch


def _encoder_arguments(config: Any, required: bool = True) -> list[str]:
    """The arguments (``required``: those without a default) of the image encoder (the model class's
    ``get_image_features``) of ``config``."""
    import inspect

    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(config), None)
    fn = getattr(cls, "get_image_features", None)
    if fn is None:  # (only its base model has one: Dots3Note's, which the sweep's encoder call uses anyway)
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        fn = getattr(MODEL_MAPPING.get(type(config), None), "get_image_features", None)
    if fn is None:
        return []
    params = inspect.signature(fn).parameters.values()
    return [
        p.name
        for p in params
        if (p.default is p.empty or not required) and p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"
    ]


def _masked_images(config: Any, count: int, seed: int) -> tuple[dict, int]:
    """Idefics2's, Idefics3's and SmolVLM's processor output for ``count`` images of the vision size, not split into
    tiles (its ``do_image_splitting=False``): one text row's images, ``(1, images, channels, size, size)``, and the
    mask of their real pixels, ``(1, images, size, size)`` (all real: no padding at the vision size)."""
    import torch

    pixels, size = _pixels(config, count, seed)
    mask = torch.ones(1, count, size, size, dtype=torch.long)
    return {"pixel_values": pixels.unsqueeze(0), "pixel_attention_mask": mask}, size


def _sized_images(config: Any, count: int, seed: int) -> tuple[dict, int]:
    """The processor's output for ``count`` square images of the vision size, of a model that takes each image's size
    (``image_sizes``, ``(images, 2)``: height, width). LLaVA-NeXT's (a config with ``image_grid_pinpoints``: any
    resolution): each image resized to its best grid of vision-size tiles and cut into them after one tile of the
    whole image, stacked as ``(images, tiles, channels, size, size)``, the tile count from upstream's
    ``image_size_to_num_patches``; Mistral 3's (Pixtral's tower): ``(images, channels, height, width)``, of an image
    of 4 x 4 merged patches (its processor keeps an image smaller than its largest size as it is)."""
    import sys

    import torch

    pixels, size = _pixels(config, count, seed)
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    vision = config.vision_config
    merge = int(getattr(config, "spatial_merge_size", 1) or 1)
    if not pinpoints and size > 4 * vision.patch_size * merge:
        # (Pixtral's processor keeps an image under its largest size as it is, rounded up to whole merged patches:
        # a small one of 4 x 4 merged patches)
        size = 4 * vision.patch_size * merge
        pixels = pixels[..., :size, :size].contiguous()
    sizes = torch.tensor([[size, size]] * count)
    if pinpoints:
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

        module = sys.modules[MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)].__module__]
        tiles = module.image_size_to_num_patches(image_size=(size, size), grid_pinpoints=pinpoints, patch_size=size)
        g = torch.Generator().manual_seed(seed)
        pixels = torch.randn(count, tiles, *pixels.shape[1:], generator=g)
    return {"pixel_values": pixels, "image_sizes": sizes}, size


def _pixels(config: Any, count: int, seed: int):
    import torch

    vision = getattr(config, "vision_config", None)
    size = getattr(vision, "image_size", None)
    size = size[0] if isinstance(size, (list, tuple)) else size
    if not isinstance(size, int):
        raise LookupError("its vision config names no image_size")
    channels = int(getattr(vision, "num_channels", 3) or 3)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(count, channels, size, size, generator=g), size


def _image_token(config: Any) -> int:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise LookupError("its config names no image token (image_token_id)")


def _inputs(model: Any, tokens: int, count: int, text: int, seed: int) -> dict:
    """A processor's output on the host: ``text`` tokens, each image's ``tokens`` image tokens, three more."""
    import torch

    g = torch.Generator().manual_seed(seed)
    config = model.config
    image = _image_token(config)
    one = torch.full((1, tokens), image)
    start, end = getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None)
    if isinstance(start, int) and isinstance(end, int):  # Qwen-VL's processor puts each image between these
        one = torch.cat([torch.tensor([[start]]), one, torch.tensor([[end]])], dim=1)
    before, after = torch.randint(3, 60, (1, text), generator=g), torch.randint(3, 60, (1, 3), generator=g)
    special = [v for k, v in vars(config).items() if k.endswith(("_token_id", "_token_index")) and isinstance(v, int)]
    for part in (before, after):  # (text, not a special token: Mistral 3's image token is 10)
        part[torch.isin(part, torch.tensor(special))] = min(set(range(3, 60)) - set(special))
    ids = torch.cat([before, *[one] * count, after], dim=1)
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **_images(config, count, seed)[0]}
    if _takes_token_types(model):  # Gemma 3's processor marks the image tokens
        kwargs["token_type_ids"] = (ids == image).long()
    if "image_grid_thw" in kwargs and _takes(model, "mm_token_type_ids"):  # Qwen-VL's marks them by modality
        kwargs["mm_token_type_ids"] = (ids == image).int()
    if "image_position_ids" in kwargs and _takes(model, "mm_token_type_ids"):  # Gemma 4's too
        kwargs["mm_token_type_ids"] = (ids == image).long()
    return kwargs


def _takes_token_types(model: Any) -> bool:
    return _takes(model, "token_type_ids")


def _takes(model: Any, name: str) -> bool:
    import inspect

    return name in inspect.signature(model.forward).parameters


def _feature_tokens(model: Any, encoded: Any) -> int:
    """How many prompt tokens the encoded images fill: their features' elements over the text's hidden size."""
    import torch

    pooled = getattr(encoded, "pooler_output", encoded)
    tensors = pooled if isinstance(pooled, (list, tuple)) else [pooled]
    hidden = int(model.config.get_text_config(decoder=True).hidden_size)
    widths = {int(t.shape[-1]) for t in tensors if isinstance(t, torch.Tensor)}
    if pooled is None and isinstance(getattr(encoded, "last_hidden_state", None), torch.Tensor):
        # an encoder whose features the forward projects itself (Llama 4's: its multi_modal_projector after
        # get_image_features): one prompt token per feature vector of the tower's width
        features = encoded.last_hidden_state
        return int(features.numel()) // int(features.shape[-1])
    if widths != {hidden}:  # a processor fills one prompt token per feature vector of the text's width
        raise LookupError(f"its image features are {sorted(widths)} wide, its text {hidden}")
    return sum(int(t.numel()) for t in tensors if isinstance(t, torch.Tensor)) // hidden


def measure(model_type: str, new_tokens: int = 8, workdir: str | None = None) -> dict:
    """One architecture's row (see the module docstring); raises only for a failure outside the model."""
    import hf_tpu
    import hf_tpu.sim

    hf_tpu.sim.enable()
    with hf_tpu.enabled():
        return _measure(model_type, new_tokens)


def _measure(model_type: str, new_tokens: int) -> dict:
    import warnings

    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    import hf_tpu
    import hf_tpu.sim
    from hf_tpu.transformers import explain

    row: dict[str, Any] = {"arch": model_type}
    try:
        config = tiny_vlm_config(model_type)
        cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
        torch.manual_seed(0)
        cpu = cls._from_config(config).eval()
        tpu = cls._from_config(config).eval()
        tpu.load_state_dict(cpu.state_dict())
    except Exception as e:  # noqa: BLE001 - any failure to build is this architecture's verdict
        row.update(status="not buildable", reason=f"{type(e).__name__}: {arch_sweep._line(e)}")
        return row
    try:
        encoder = getattr(cpu.base_model, "get_image_features", None)
        if encoder is None:
            raise LookupError("its base model has no get_image_features")
        images, size = _images(cpu.config, 1, 0)
        with torch.no_grad():
            tokens = _feature_tokens(cpu, encoder(**images, return_dict=True))
        calls = [(1, 5, 0), (2, 4, 1), (1, 9, 2)]  # (images, text tokens, seed)
        prompts = [_inputs(cpu, tokens, *call) for call in calls]
    except Exception as e:  # noqa: BLE001 - the generic processor stand-in does not fit this model
        row.update(status=_NO_INPUTS, reason=f"{type(e).__name__}: {arch_sweep._line(e)}")
        return row
    kw = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0, "max_new_tokens": new_tokens}
    try:
        with torch.no_grad():
            expected = [cpu.generate(**p, **kw) for p in prompts]
    except Exception as e:  # noqa: BLE001 - upstream fails on the CPU too: not a TPU problem
        row.update(status="fails on CPU", reason=f"{type(e).__name__}: {arch_sweep._line(e)}")
        return row
    row["image_tokens"] = tokens
    stage = "placing the model"
    reads = len(hf_tpu.sim.host_reads())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tpu.to("tpu")
            route = explain(tpu, **prompts[0], **kw)
            fast = route.fast
            runs, stats = [], []
            if fast and size is not None:
                stage = "warm-up"
                longest = max(p["input_ids"].shape[1] for p in prompts)
                bucket = 1 << (longest - 1).bit_length()
                hf_tpu.warmup(
                    tpu, max_prompt_len=bucket, buckets=[bucket, 2 * bucket], max_new_tokens=new_tokens,
                    image_sizes=[(size, size)],
                    num_images=[1, 2], progress=False,
                )  # fmt: skip
            for index, p in enumerate(prompts):
                stage = f"call {index + 1}"
                with hf_tpu.sim.stats() as s:
                    runs.append(tpu.generate(**p, **kw))
                stats.append(s)
            stage = "short run"  # the third call's prompt for 2 tokens: the difference is the decode steps'
            with hf_tpu.sim.stats() as short:
                tpu.generate(**prompts[-1], **{**kw, "max_new_tokens": 2})
    except Exception as e:  # noqa: BLE001
        row.update(status="error", reason=f"{stage}: {type(e).__name__}: {arch_sweep._line(e)}")
        return row
    route = explain(tpu, **prompts[0], **kw)  # after what the first traces found
    identical = all(torch.equal(got.cpu(), want) for got, want in zip(runs, expected, strict=True))
    h2d, d2h = arch_sweep._per_step(stats[-1], short, new_tokens - 2)
    sites = hf_tpu.sim.host_reads()[reads:]  # warm-up's graphs and the calls' (torch_tpu refuses those that read)
    row.update(
        status="fast path" if route.fast else "upstream loop",
        route=route.loop,
        reason=arch_sweep.host_read_note(sites) if route.fast else route.reason,
        identical=identical,
        compiles_2nd=max(s.compiles for s in stats[1:]),
        signatures_2nd=max(s.shape_signatures for s in stats[1:]),
        h2d_per_step=round(h2d, 2),
        d2h_per_step=round(d2h, 2),
        host_reads=len(sites),
    )
    return row


# ---- the sweep: the causal-LM sweep's workers ---------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (the causal-LM sweep's)."""
    arch_sweep.add_arguments(parser)
    parser.set_defaults(new_tokens=8)


def run(args: argparse.Namespace) -> dict:
    """Sweep; returns ``{"rows": [...], "summary": {...}, "command": str}`` (and writes the docs section if asked)."""
    from pathlib import Path

    archs = args.archs or architectures()
    unknown = sorted(set(archs) - set(architectures()))
    if unknown:
        raise SystemExit(f"unknown image-text-to-text architectures {unknown}")
    start = time.monotonic()
    if args.from_rows:  # ("docs": the rows of the section the page holds now, read back by rows_from_docs)
        saved = arch_sweep._saved_rows([p for p in args.from_rows if p != "docs"])
        if "docs" in args.from_rows:
            for arch, row in rows_from_docs().items():
                saved.setdefault(arch, row)
        missing = {"status": "not measured", "reason": "not reached by the run that made this table"}
        rows = [saved.get(a) or {"arch": a, **missing} for a in archs]
    else:
        saved = arch_sweep._saved_rows([args.rows]) if args.resume and args.rows and Path(args.rows).exists() else {}
        todo = [a for a in archs if a not in saved]
        fresh = {
            r["arch"]: r
            for r in arch_sweep.sweep(
                todo, args.new_tokens, args.jobs, args.timeout, rows_file=args.rows, module=__name__
            )
        }
        rows = [saved.get(a) or fresh[a] for a in archs]
    if args.archs and args.write_docs:  # a partial run: the others are listed as not measured
        rows = [*rows, *({"arch": a, "status": "not measured", "reason": "not in this run's --archs"}
                         for a in architectures() if a not in archs)]  # fmt: skip
        rows.sort(key=lambda r: r["arch"])
    summary = summarize(rows)
    figures = {"rows": rows, "summary": summary, "seconds": round(time.monotonic() - start)}
    figures["targets_met"] = summary["meets_targets"] >= TARGET_SHARE * summary["buildable"]
    figures["command"] = "python benchmarks/vlm_sweep.py " + " ".join(
        ([f"--archs {' '.join(archs)}"] if args.archs else [])
        + ([f"--new-tokens {args.new_tokens}"] if args.new_tokens != 8 else [])
        + ["--write-docs"]
    )
    if args.write_docs:
        write_section(markdown(figures))
        print(f"wrote the image-text-to-text section of {arch_sweep.DOCS_PAGE}")
    return figures


def rows_from_docs(path=None) -> dict[str, dict]:
    """The rows the page's image-text-to-text section holds (what :func:`markdown` wrote from them), by architecture:
    an earlier sweep's rows, when its rows files are gone (``--from-rows NEW.jsonl docs`` adds new rows to the section
    and keeps every other row as it is). Writing them back with :func:`markdown` gives the same table rows.

    Args:
        path: the page (default: docs/architectures.md).

    Returns:
        Architecture -> its row (``status``, ``route``, ``identical``, ``compiles_2nd``, ``signatures_2nd``, the
        copies per step and ``reason`` as the table gives them).
    """
    import re
    from pathlib import Path

    rows: dict[str, dict] = {}
    section = Path(path or arch_sweep.DOCS_PAGE).read_text().partition(SECTION)[2]
    for line in section.splitlines():
        if not line.startswith("| "):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) != 8 or cells[0] in ("architecture", "") or set(cells[0]) <= {"-"}:
            continue
        arch, status, route, identical, compiles, signatures, copies, reason = cells
        row: dict = {"arch": arch, "status": status}
        if route:
            row["route"] = route
        if identical:
            row["identical"] = identical == "yes"
        if compiles:
            row["compiles_2nd"] = arch_sweep._number(compiles)
        if signatures:
            row["signatures_2nd"] = arch_sweep._number(signatures)
        if copies:
            row["h2d_per_step"], row["d2h_per_step"] = arch_sweep._copies_per_step(copies)
        if reason:
            row["reason"] = reason.replace("\\|", "|")
        rows[arch] = row
    return rows


def write_section(text: str) -> None:
    """Replace this sweep's section of docs/architectures.md (from :data:`SECTION` to the end) with ``text``."""
    page = arch_sweep.DOCS_PAGE
    current = page.read_text()
    head = current.split(SECTION, 1)[0].rstrip("\n")
    page.write_text(head + "\n\n" + text)


# The targets a measured, buildable row misses (empty: it meets every one): the causal-LM sweep's, copies per decode
# step included.
misses = arch_sweep.misses


def summarize(rows: list[dict]) -> dict:
    measured = [r for r in rows if r["status"] != "not measured"]
    buildable = [r for r in measured if r["status"] not in _UNBUILT]
    return {
        "architectures": len(rows),
        "measured": len(measured),
        "no_inputs": sum(r["status"] == _NO_INPUTS for r in rows),
        "buildable": len(buildable),
        "fast_path": sum(r["status"] == "fast path" for r in rows),
        "meets_targets": sum(not misses(r) for r in buildable),
        "identical": sum(bool(r.get("identical")) for r in rows),
        "crashes": sum(r["status"] in ("crash", "error", "timeout") for r in rows),
    }


def _target_line(s: dict) -> str:
    share = s["meets_targets"] / s["buildable"] if s["buildable"] else 0.0
    verdict = "met" if share >= TARGET_SHARE else "**missed**"
    return (
        f"{s['meets_targets']} of {s['buildable']} buildable architectures meet the targets ({share:.1%}; the issue's "
        f"target is {TARGET_SHARE:.0%}): {verdict}."
    )


def markdown(figures: dict) -> str:
    rows, s = figures["rows"], figures["summary"]
    lines = [
        SECTION,
        "",
        f"Generated by `{figures['command']}` (hf_tpu/benchmarks/vlm_sweep.py; do not edit by hand). Each",
        "image-text-to-text architecture of the installed transformers (`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING`), a tiny",
        "random model built from its config class with the causal-LM sweep's rules (special-token ids past the",
        "shrunk vocabulary moved into it), on the CPU and on the simulated `tpu` after `hf_tpu.enable()`; images as",
        "its processor returns them for its own vision size (`pixel_values` `(images, channels, size, size)`; Qwen-VL's",
        "patch rows and grids; LLaVA-NeXT's tiles and Mistral 3's small image with `image_sizes`; Idefics2/3's",
        "per text row with `pixel_attention_mask`; Gemma 4's patch rows with `image_position_ids`) and as many",
        "image tokens as",
        "its `get_image_features` gives features. Greedy `generate` of "
        f"{_new_tokens(figures)} tokens: one image, two images, another image with a longer prompt; *identical*: all",
        "three equal the CPU's. *compiles* and *new signatures* (new eager op shapes): the most of the second and",
        "third calls, after `hf_tpu.warmup(..., image_sizes=[(size, size)], num_images=[1, 2])` on hf_tpu's loop",
        "(upstream's loop: after the first call). *route*: `hf_tpu.transformers.explain` after the calls.",
        "*copies/step*: host->device + device->host copies per decode step (the third call's prompt for "
        f"{_new_tokens(figures)} and for 2",
        "tokens, differenced). Targets: hf_tpu's loop (fast path), identical, 0 compiles, <= 4 new signatures, <= 1",
        "copy each way per step, and no compiled graph (warm-up's included) that reads a device value on the host",
        "(`hf_tpu.sim.host_reads()`: torch_tpu refuses to lower such a graph; the reason names the first site).",
        "*no generic inputs*: the builder's",
        "processor stand-in does not fit the model (the reason says why); counted apart from the buildable ones.",
        "",
        f"{s['architectures']} architectures; {s['measured']} measured; {s['no_inputs']} without generic inputs; "
        f"{s['buildable']} buildable (built, inputs made, run on the CPU); {s['fast_path']} on hf_tpu's loop; "
        f"{s['identical']} token-identical; {s['crashes']} errors, crashes or timeouts."
        + (
            f" {s['architectures'] - s['measured']} not measured (not in the run's `--archs`, or not reached)."
            if s["architectures"] != s["measured"]
            else ""
        ),  # fmt: skip
        "",
        _target_line(s),
        "",
        "| architecture | status | route | identical | compiles | new signatures | copies/step | reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        reason = (r.get("reason") or "").replace("|", "\\|")
        copies = f"{arch_sweep._cell(r, 'h2d_per_step')} + {arch_sweep._cell(r, 'd2h_per_step')}" if (
            "h2d_per_step" in r) else ""  # fmt: skip
        lines.append(
            f"| {r['arch']} | {r['status']} | {r.get('route', '')} | {arch_sweep._cell(r, 'identical')} | "
            f"{arch_sweep._cell(r, 'compiles_2nd')} | {arch_sweep._cell(r, 'signatures_2nd')} | {copies} | {reason} |"
        )
    return "\n".join(lines) + "\n"


def _new_tokens(figures: dict) -> int:
    command = figures["command"].split()
    return int(command[command.index("--new-tokens") + 1]) if "--new-tokens" in command else 8


def print_table(figures: dict) -> None:
    for row in figures["rows"]:
        print(arch_sweep._one_line(row))
    s = figures["summary"]
    print(f"\n{s['architectures']} architectures, {s['buildable']} buildable, {s['fast_path']} on hf_tpu's loop "
          f"({figures['seconds']} s)")  # fmt: skip
    print(_target_line(s).replace("**", ""))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        arch_sweep._worker(sys.argv[3:], int(sys.argv[2]), measure)
    else:
        from hf_tpu.benchmarks.__main__ import main

        sys.exit(main(["vlm_sweep", *sys.argv[1:]]))
