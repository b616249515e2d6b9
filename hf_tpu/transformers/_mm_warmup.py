"""Warm-up of the graphs an image or audio ``generate`` call runs (:func:`hf_tpu.warmup`'s ``image_sizes`` and
``num_images``, and its path for models whose encoder takes features, Whisper's).

Images: per batch size, image count and pixel size, the vision graph (:func:`hf_tpu.transformers._images.encode_images`
on zero pixels of shape ``(batch * images, channels, height, width)``, the layout LLaVA's, Gemma 3's and PaliGemma's
processors return, with the images' sizes where the encoder takes them (Mistral 3's, LLaVA-NeXT's tiles); per text row
with the mask of real pixels for Idefics2's and Idefics3's; Qwen2-VL's and Qwen2.5-VL's patch rows and grids for
images of that size; Gemma 4's patch rows and positions, padded as its processor pads them), then, for every warmed
prompt bucket that holds the images' tokens, the ``mm_prefill`` graph (the model's forward merging those features,
keyed by their shape) and the decode graph of that cache, on dummy ids whose image tokens match the features, as
:func:`hf_tpu.transformers._loops.cached.decode_loop` runs them (with three rows of positions for Qwen-VL's).
:func:`hf_tpu.warmup` runs the first part of each request (:func:`check_images`: its inputs, the vision graph, the
fit of its tokens) before any text graph, so that one it cannot warm fails at once, and the second
(:func:`warm_image_prefills`) after them.

Audio: the model's own ``generate`` once per batch size on silent features of its input window (Whisper's feature
extractor pads every clip to that window, so every audio length shares it), with the keyword arguments the served
calls pass (``language=``, ``task=``: they set the decoder prompt, which is not bucketed).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

from hf_tpu.errors import InvalidArgumentError
from hf_tpu.transformers import _images
from hf_tpu.transformers._cache.static import cache_for, reset_cache, set_decoding, set_length
from hf_tpu.transformers._graph_key import GraphKind, Variant
from hf_tpu.transformers._graphs import run_graph, vision_kinds
from hf_tpu.transformers._images import ImageLayout
from hf_tpu.transformers._loops.cached import extra_inputs
from hf_tpu.transformers._loops.defaults import warm_sampling
from hf_tpu.transformers._settings import NotCompilableError, model_state
from hf_tpu.transformers._loops.skeleton import plan_shapes

__all__ = ["ImageWarmup", "check_images", "feature_window", "warm_features", "warm_image_prefills", "warm_images"]


def takes_token_types(model) -> bool:
    """Whether the model's forward takes ``token_type_ids`` (Gemma 3's and PaliGemma's processors return them with
    the images: their calls run the ``+token_type_ids`` graphs)."""
    try:
        return "token_type_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return False


def _image_token_id(model) -> int:
    token = _images.image_token_id(model)
    if token is None:
        raise NotCompilableError(
            f"hf_tpu.warmup cannot warm the images of {type(model).__name__}: its config names no image token "
            "(image_token_id), so warm-up cannot build a prompt holding the images' tokens"
        )
    return token


@dataclass
class ImageWarmup:
    """What :func:`check_images` found for ``batch`` rows of ``count`` images of ``size``: the vision graph's keys,
    the prompt tokens the images fill per row and the warmed prompt buckets holding them (the buckets
    :func:`warm_image_prefills` warms)."""

    batch: int
    size: tuple[int, int]
    count: int
    vision_keys: list[tuple]
    tokens: int
    fitting: list[int]


def warm_images(
    model, batch: int, size: tuple[int, int], count: int, prompt_buckets, max_new_tokens: int, variant: Variant
) -> list[tuple]:
    """Compile the vision graph for ``batch * count`` images of ``size`` (height, width) and the image prefill and
    decode graphs of every bucket in ``prompt_buckets`` holding their tokens; returns the keys (the vision graph's
    first). :func:`check_images`, then :func:`warm_image_prefills` on the features it encoded."""
    images, encoded = _check_images(model, batch, size, count, prompt_buckets)
    return images.vision_keys + warm_image_prefills(model, images, max_new_tokens, variant, encoded)


def check_images(model, batch: int, size: tuple[int, int], count: int, prompt_buckets) -> ImageWarmup:
    """The first half of :func:`warm_images`, which :func:`hf_tpu.warmup` runs for every image request before it
    compiles any text graph, so that one it cannot warm fails at once: builds the pixel inputs (sizes the processor
    never returns raise :class:`~hf_tpu.errors.InvalidArgumentError`), checks the model takes them and names an image
    token (:class:`~hf_tpu.transformers._settings.NotCompilableError` otherwise; the image encoder not one graph:
    that error with ``state.images_problem`` recorded), compiles and runs the vision graph, and checks the images'
    tokens fit a bucket of ``prompt_buckets`` (InvalidArgumentError naming ``max_prompt_len`` otherwise)."""
    return _check_images(model, batch, size, count, prompt_buckets)[0]


def _check_images(model, batch: int, size: tuple[int, int], count: int, prompt_buckets) -> tuple[ImageWarmup, dict]:
    """:func:`check_images`, and the vision graph's output (the ``mm_encoder_outputs`` the image prefill takes)."""
    import torch

    state = model_state(model)
    height, width = (int(n) for n in size)
    kwargs = _pixel_inputs(model, batch, count, height, width)
    if not _images.image_inputs(model, kwargs):
        raise NotCompilableError(
            f"hf_tpu.warmup cannot warm the images of {type(model).__name__}: its image encoder takes no pixel_values "
            "of shape (images, channels, height, width)"
        )
    problem = _images.images_problem(model, kwargs)
    if problem is not None:
        raise NotCompilableError(f"{problem}; generate runs upstream's loop for such calls, so warm-up has no graph")
    _image_token_id(model)  # (a config naming none: refused before the vision graph compiles)
    before = list(state.compile_log)
    with torch.no_grad():
        encoded = _images.encode_images(model, state, kwargs, run_graph)["mm_encoder_outputs"]
    kinds = tuple(GraphKind(base) for base in vision_kinds())
    keys = [k for k in state.compile_log if k not in before and k.kind in kinds]
    keys = keys or [k for k in state.compiled if k.kind in kinds and k.batch == batch * count]
    tokens, rest = divmod(_images.feature_tokens(model, encoded["image"]), batch)
    fitting = [p for p in prompt_buckets if p >= tokens]
    if rest or not fitting:
        raise InvalidArgumentError(
            f"warm-up for {count} image(s) of {height}x{width}: they fill {tokens} prompt tokens per row, more than "
            f"the largest warmed prompt bucket ({max(prompt_buckets)}): raise max_prompt_len"
        )
    return ImageWarmup(batch, (height, width), count, keys, tokens, fitting), encoded


def warm_image_prefills(
    model, images: ImageWarmup, max_new_tokens: int, variant: Variant, encoded: dict | None = None
) -> list[tuple]:
    """The second half of :func:`warm_images`: compile the image prefill and decode graphs of every bucket of
    ``images.fitting`` on the vision graph's features ``encoded``; returns their keys. Without ``encoded`` the vision
    graph :func:`check_images` compiled runs again (nothing compiled): :func:`hf_tpu.warmup` keeps no request's
    features on the device while it warms the text and the other requests' graphs."""
    import torch

    state = model_state(model)
    device = model.device
    batch, tokens = images.batch, images.tokens
    layout = _images.image_layout(model)
    if encoded is None:
        kwargs = _pixel_inputs(model, batch, images.count, *images.size)
        with torch.no_grad():
            encoded = _images.encode_images(model, state, kwargs, run_graph)["mm_encoder_outputs"]
    types = takes_token_types(model)
    image_id = _image_token_id(model)
    extra = extra_inputs(model)
    rows = 1 if layout is None else layout.position_rows
    mm_types = layout is ImageLayout.POSITIONED  # (Gemma 4's processor marks the image tokens: mm_token_type_ids)
    named = {"token_type_ids": types, "mrope": rows > 1, "mm_token_type_ids": mm_types}
    kind_variant = variant.with_features(*(feature for feature, on in named.items() if on))
    keys = []
    with torch.no_grad():
        for p in images.fitting:
            plan = plan_shapes(model, batch, p, max_new_tokens, variant=kind_variant)
            c = plan.cache_bucket
            cache = cache_for(model, state, batch, c, None)
            mask_dev = torch.ones(batch, c, dtype=torch.bool).to(device)
            ids = torch.zeros(batch, p, dtype=torch.long)
            ids[:, p - tokens :] = image_id
            pos = torch.arange(p, dtype=torch.long).expand(batch, p)
            sampling = warm_sampling(model, ids, variant, c + 1, 0)
            prefill_extra = dict(extra)  # (in the loop's order: the graphs guard on it)
            if types:
                prefill_extra["token_type_ids"] = (ids == image_id).long().to(device)
            if mm_types:
                prefill_extra["mm_token_type_ids"] = (ids == image_id).long().to(device)
            prefill_extra["mm_encoder_outputs"] = encoded
            prefill_key = (GraphKind("mm_prefill", kind_variant), batch, p, c, _images.features_shape(encoded))
            decode_key = (GraphKind("decode", kind_variant), batch, c)
            set_length(cache, 0)
            run_graph(model, state, prefill_key, torch.cat([ids, *[pos] * rows], dim=1).to(device), mask_dev, cache,
                 prefill_extra, sampling)  # fmt: skip
            set_decoding(cache, True)
            step = torch.tensor([[0, *[p] * rows]], dtype=torch.long).expand(batch, 1 + rows).contiguous().to(device)
            set_length(cache, p)
            run_graph(model, state, decode_key, step, mask_dev, cache, extra, sampling)
            reset_cache(cache)
            keys += [prefill_key, decode_key]
    return keys


def _pixel_inputs(model, batch: int, count: int, height: int, width: int) -> dict:
    """What the model's processor returns for ``batch`` rows of ``count`` images of ``height`` x ``width`` pixels, in
    the layout of its image path (float32: what image processors return; the vision towers cast them to their own
    dtype)."""
    layout = _images.image_layout(model)
    if layout is not None and layout.grid:
        return _grid_pixels(model, batch * count, height, width)
    if layout is ImageLayout.POSITIONED:
        return _positioned_pixels(model, batch * count, height, width)
    channels = int(getattr(getattr(model.config, "vision_config", None), "num_channels", 3) or 3)
    return _processor_pixels(model, batch, count, channels, height, width)


def _processor_pixels(model, batch: int, count: int, channels: int, height: int, width: int) -> dict:
    """What the model's processor returns for ``count`` images of ``height`` x ``width`` pixels per row of ``batch``,
    in the layout its image encoder (``get_image_features``) takes: ``(images, channels, height, width)``; with each
    image's size (``image_sizes``: Mistral 3's, and LLaVA-NeXT's whose images are tiles of the vision size, one of the
    whole image first, ``(images, tiles, channels, size, size)``); per text row with the mask of real pixels
    (``pixel_attention_mask``: Idefics2's, Idefics3's, SmolVLM's, ``(rows, images, channels, height, width)``, pixels of
    one, as their encoder drops all-zero images as padding)."""
    import sys

    import torch

    params = inspect.signature(_images._encoder_fn(model)).parameters
    if "pixel_attention_mask" in params:
        return {
            "pixel_values": torch.ones(batch, count, channels, height, width),
            "pixel_attention_mask": torch.ones(batch, count, height, width, dtype=torch.long),
        }
    pixels = torch.zeros(batch * count, channels, height, width)
    if "image_sizes" not in params or params["image_sizes"].default is not inspect.Parameter.empty:
        # (LLaVA's encoder takes image_sizes optionally, for Pixtral towers; its processor returns none)
        return {"pixel_values": pixels}
    pinpoints = getattr(model.config, "image_grid_pinpoints", None)
    if pinpoints:  # (upstream's own count of the tiles its processor cuts an image of that size into)
        tile = int(model.config.vision_config.image_size)
        tiles = sys.modules[type(model).__module__].image_size_to_num_patches(
            image_size=(height, width), grid_pinpoints=pinpoints, patch_size=tile
        )
        pixels = torch.zeros(batch * count, tiles, channels, tile, tile)
    return {"pixel_values": pixels, "image_sizes": torch.tensor([[height, width]] * (batch * count))}


def _grid_pixels(model, images: int, height: int, width: int) -> dict:
    """What Qwen2-VL's image processor returns for ``images`` images resized to ``height`` x ``width`` pixels: their
    patch rows (``temporal_patch_size`` frames of ``patch_size``-square patches per row) and each one's grid."""
    import torch

    vision = model.config.vision_config
    patch, merge = int(vision.patch_size), int(vision.spatial_merge_size)
    if height % (patch * merge) or width % (patch * merge):
        raise InvalidArgumentError(
            f"image_sizes: {type(model).__name__} takes images whose sides are multiples of patch_size x "
            f"spatial_merge_size ({patch * merge} pixels; its image processor resizes them so), got {height}x{width}"
        )
    channels = int(getattr(vision, "in_channels", 3) or 3)
    rows, cols = height // patch, width // patch
    row_width = channels * int(getattr(vision, "temporal_patch_size", 1)) * patch * patch  # (1: still images)
    return {
        "pixel_values": torch.zeros(images * rows * cols, row_width),
        "image_grid_thw": torch.tensor([[1, rows, cols]] * images),
    }


# Gemma 4's image processors' choices of max_soft_tokens (the tokens an image may fill; its rows are padded to them)
_SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)


def _positioned_pixels(model, images: int, height: int, width: int) -> dict:
    """What Gemma 4's (or Gemma 4 Unified's) image processor returns for ``images`` images resized to ``height`` x
    ``width`` pixels: their patch rows (zero pixels) and each row's (x, y) position, padded to the least of its
    ``max_soft_tokens`` choices that holds the image's tokens (the processor resizes an image to nearly fill the budget
    it is given, so an image of this size came from that budget: the padded length the served calls have)."""
    import torch

    vision = model.config.vision_config
    patch, kernel = int(vision.patch_size), int(vision.pooling_kernel_size)
    if hasattr(vision, "model_patch_size"):  # (Gemma 4 Unified: one row per merged kernel of patches)
        patch, kernel = int(vision.model_patch_size), 1
    if height % (patch * kernel) or width % (patch * kernel):
        raise InvalidArgumentError(
            f"image_sizes: {type(model).__name__} takes images whose sides are multiples of its pooling kernel "
            f"({patch * kernel} pixels; its image processor resizes them so), got {height}x{width}"
        )
    cols, rows = width // patch, height // patch
    tokens = cols * rows // (kernel * kernel)
    budget = next((b for b in _SOFT_TOKEN_BUDGETS if b >= tokens), None)
    if budget is None:
        raise InvalidArgumentError(
            f"image_sizes: {height}x{width} fills {tokens} image tokens, more than {type(model).__name__}'s image "
            f"processor gives an image ({_SOFT_TOKEN_BUDGETS[-1]})"
        )
    length = budget * kernel * kernel
    ys, xs = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    positions = torch.full((images, length, 2), -1, dtype=torch.long)
    positions[:, : rows * cols] = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
    return {"pixel_values": torch.zeros(images, length, 3 * patch * patch), "image_position_ids": positions}


def feature_window(model) -> tuple[int, int]:
    """The ``(feature size, frames)`` of one input window of a model whose encoder takes features: Whisper's
    ``num_mel_bins`` and ``max_source_positions`` times its convolutions' strides (the feature extractor pads
    every clip to it)."""
    import torch

    config = model.config
    mel, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if not isinstance(mel, int) or not isinstance(positions, int):
        raise NotCompilableError(
            f"hf_tpu.warmup cannot warm {type(model).__name__}: its config gives no fixed input window "
            "(num_mel_bins and max_source_positions, as Whisper's does), so the features' shape is not known ahead "
            "of a call; the first generate of each shape compiles its graphs, and later ones with that shape nothing"
        )
    strides = [m.stride[0] for m in model.get_encoder().modules() if isinstance(m, torch.nn.Conv1d)]
    return mel, positions * math.prod(strides)


def warm_features(model, batch: int, max_new_tokens: int, generate_kwargs: dict) -> list[tuple]:
    """Run the model's own ``generate`` on silent features of its window for ``batch`` clips (what the feature
    extractor returns, on the host) with ``generate_kwargs``; returns the keys of the graphs it ran."""
    import torch

    state = model_state(model)
    mel, frames = feature_window(model)
    before = len(state.compile_log)
    seen = set(state.compiled)
    features = torch.zeros(batch, mel, frames)
    with torch.no_grad():
        model.generate(features, max_new_tokens=max_new_tokens, **generate_kwargs)
    keys = list(state.compile_log[before:])
    # the graphs a call of this batch size and window ran before (a second warm-up of the same shapes)
    keys += [k for k in seen if k.batch == batch and k.kind.base in _FEATURE_KINDS and k not in keys]
    return keys


_FEATURE_KINDS = ("features_encoder", "seq2seq_prefill", "seq2seq_decode")
