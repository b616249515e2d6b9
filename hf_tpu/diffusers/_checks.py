"""Checks that turn a diffusion call the TPU cannot run into an error that says what to do.

Diffusers pipelines already reject some bad inputs, but on a TPU three mistakes cost more than elsewhere: an
image size the VAE or the denoiser cannot take fails deep inside a compiled graph (or compiles a graph for
nothing), a generator on the wrong device fails with a bare torch message, and a component that did not move
to the TPU only shows up as a device mismatch in the middle of the denoising loop. These helpers catch all three
before any work is done.

Example:
    >>> from hf_tpu.diffusers import check_resolution
    >>> check_resolution(pipe, 512, 512)  # doctest: +SKIP
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from hf_tpu.errors import InvalidArgumentError, InvalidTypeError, SetupError

__all__ = [
    "check_components_on",
    "check_frames",
    "check_generator",
    "check_resolution",
    "denoiser",
    "denoisers",
    "frame_multiple",
    "resolution_limits",
]

# The modules a pipeline calls once per denoising step, in the order upstream pipelines name them: the experts of a
# two-stage model (Wan 2.2's ``transformer`` and ``transformer_2``), the UNet, the prior and decoder of a two-stage
# pipeline (Kandinsky, Wuerstchen, Stable Cascade) and the ControlNet that runs beside the denoiser.
DENOISERS = ("transformer", "unet", "prior", "decoder")
# MiniMax-H3's ``ref2va`` workflow denoises with ``transformer_ref`` (a second checkpoint partition).
_EXTRA = re.compile(
    r"^(transformer|unet|prior|decoder)_\d+$|^(controlnet|prior_prior|image_unet|text_unet|transformer_ref)$"
)


def denoisers(pipe: Any) -> list[tuple[str, Any]]:
    """Every module the pipeline calls once per step: its denoiser(s), experts, prior, decoder and ControlNet.

    Args:
        pipe: a ``DiffusionPipeline`` or ``ModularPipeline``.

    Returns:
        ``(name, module)`` pairs: the first denoiser found (``transformer``, ``unet``, ...), then the other
        per-step modules among the components (``transformer_2``, ``prior``, ``controlnet``, ...).

    Raises:
        ValueError: the pipeline has no denoiser (see :func:`denoiser`).

    Example:
        >>> [name for name, _ in denoisers(wan22_pipe)]  # doctest: +SKIP
        ['transformer', 'transformer_2']
    """
    import torch

    found = [(n, m) for n in DENOISERS if isinstance(m := getattr(pipe, n, None), torch.nn.Module)]
    extra = sorted(n for n, m in pipe.components.items() if isinstance(m, torch.nn.Module) and _EXTRA.match(n))
    found += [(n, getattr(pipe, n)) for n in extra if n not in dict(found)]
    if not found:
        denoiser(pipe)  # raises, naming the components there are
    return found


def denoiser(pipe: Any) -> tuple[str, Any]:
    """The name and module of the pipeline's denoiser (``transformer`` for DiT pipelines, ``unet`` for UNets).

    Args:
        pipe: a ``DiffusionPipeline`` or ``ModularPipeline``.

    Returns:
        ``(name, module)`` of the first denoiser attribute that holds a module.

    Raises:
        ValueError (InvalidArgumentError): no denoiser module; the message lists the model components there are.

    Example:
        >>> name, module = denoiser(pipe)  # doctest: +SKIP
        >>> name
        'transformer'
    """
    import torch

    for name in DENOISERS:
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module):
            return name, module
    components = ", ".join(k for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)) or "none"
    raise InvalidArgumentError(
        f"{type(pipe).__name__} has no denoiser to compile: looked for a module named one of {', '.join(DENOISERS)} "
        f"and found these model components: {components}. Compile the module yourself with "
        f"module.compile(backend='tpu', fullgraph=True, dynamic=False)."
    )


def _spatial_patch(config: Any) -> tuple[int, int]:
    """The denoiser's patch as (height, width): an int, a (h, w) pair, or a (frames, h, w) video patch."""
    patch = getattr(config, "patch_size", None) or 1
    if isinstance(patch, (list, tuple)):
        sides = [int(p) for p in patch] or [1]
        return (sides[-2], sides[-1]) if len(sides) >= 2 else (sides[0], sides[0])
    return int(patch), int(patch)


def _vae_scale(pipe: Any) -> int:
    """How many pixels one latent covers along a side (``vae_scale_factor_spatial`` of video pipelines)."""
    for attr in ("vae_scale_factor_spatial", "vae_spatial_compression_ratio", "vae_scale_factor"):
        try:
            value = getattr(pipe, attr, None)
        except Exception:  # a modular pipeline's property needing a component that is not loaded yet
            value = None
        if isinstance(value, int) and value > 0:
            return value
    config = getattr(getattr(pipe, "vae", None), "config", None)
    for attr in ("scale_factor_spatial", "spatial_compression_ratio"):
        if isinstance(value := getattr(config, attr, None), int) and value > 0:
            return value
    blocks = getattr(config, "block_out_channels", None)
    return 2 ** (len(blocks) - 1) if blocks else 8


def resolution_limits(pipe: Any) -> tuple[int, int | None]:
    """``(multiple, largest)``: image sides must be multiples of ``multiple``; ``largest`` is None if unbounded.

    ``multiple`` is the VAE's spatial downscale factor times the denoiser's patch (1 for a UNet; the spatial sides
    of a tuple patch such as Wan's ``(1, 2, 2)``); ``largest`` comes from the transformer's positional-embedding
    table where it has one (``pos_embed_max_size`` in SD3).

    Args:
        pipe: a ``DiffusionPipeline`` or ``ModularPipeline``.

    Returns:
        ``(multiple, largest)`` in pixels.

    Raises:
        ValueError: the pipeline has no denoiser (see :func:`denoiser`).
    """
    vae_scale = _vae_scale(pipe)
    name, module = denoiser(pipe)
    config = getattr(module, "config", None)
    ph, pw = _spatial_patch(config) if name != "unet" else (1, 1)
    multiple = vae_scale * math.lcm(ph, pw)
    largest = None
    pos_max = getattr(config, "pos_embed_max_size", None)
    if isinstance(pos_max, int) and pos_max > 0:
        largest = pos_max * vae_scale * min(ph, pw)
        largest -= largest % multiple
    return multiple, largest


def frame_multiple(pipe: Any) -> int | None:
    """The VAE's temporal compression of a video pipeline (``num_frames - 1`` must be a multiple), else None.

    Args:
        pipe: a ``DiffusionPipeline`` or ``ModularPipeline``.

    Returns:
        The temporal factor read from the pipeline or its VAE config, or None for an image pipeline.
    """
    value = None
    for attr in ("vae_scale_factor_temporal", "vae_temporal_compression_ratio"):  # Wan, Cosmos...; LTX
        try:
            value = getattr(pipe, attr, None)
        except Exception:  # a modular pipeline's property needing a component that is not loaded yet
            value = None
        if isinstance(value, int) and value > 0:
            break
    if not isinstance(value, int) or value <= 0:
        config = getattr(getattr(pipe, "vae", None), "config", None)
        value = getattr(config, "scale_factor_temporal", None) or getattr(config, "temporal_compression_ratio", None)
    return value if isinstance(value, int) and value > 0 else None


def check_frames(pipe: Any, num_frames: Any) -> None:
    """Raise ``ValueError`` if a video pipeline's VAE cannot encode ``num_frames`` frames, naming valid counts.

    The causal video VAEs (Wan, LTX, HunyuanVideo, Cosmos...) keep the first frame and compress the rest by their
    temporal factor ``t``: a clip has ``k * t + 1`` frames (Allegro's VAE does not: it takes ``ceil(n / t)``
    latent frames; do not use this check for it). Each call of an LTX pipeline is checked (they floor a bad count
    silently); Wan rounds it itself with a warning. A chunked video VAE (MiniMax-H3: ``17n + 5`` frames within the
    model's 5 to 15 seconds) is checked by :func:`check_chunked_frames`.

    Args:
        pipe: a video pipeline (an image pipeline, or ``num_frames=None``, passes unchecked).
        num_frames: the frame count the call asks for.

    Raises:
        ValueError (InvalidArgumentError): ``num_frames`` is not a positive int, or not ``k * t + 1`` (or, for a
            chunked VAE, not a count it takes); the message names the nearest valid counts.

    Example:
        >>> check_frames(wan_pipe, 10)  # doctest: +SKIP
        ValueError: WanPipeline cannot make 10 frames: ... nearest valid counts: 9, 13
    """
    from hf_tpu.diffusers._av_checks import check_chunked_frames, chunked_frames

    if chunked_frames(pipe) is not None:  # MiniMax-H3: 17n + 5 frames, 5 to 15 seconds
        check_chunked_frames(pipe, num_frames)
        return
    t = frame_multiple(pipe)
    if t is None or num_frames is None:
        return
    if not isinstance(num_frames, int) or isinstance(num_frames, bool) or num_frames < 1:
        raise InvalidArgumentError(
            f"{type(pipe).__name__}: num_frames={num_frames!r} must be a positive int (k*{t} + 1)."
        )
    if (num_frames - 1) % t == 0:
        return
    down = (num_frames - 1) // t * t + 1
    raise InvalidArgumentError(
        f"{type(pipe).__name__} cannot make {num_frames} frames: its VAE compresses time by {t} after the first "
        f"frame, so a clip has k*{t} + 1 frames; nearest valid counts: {down}, {down + t}."
    )


def check_resolution(pipe: Any, height: int, width: int) -> None:
    """Raise ``ValueError`` if the pipeline cannot make a ``height`` x ``width`` image, naming valid sizes.

    Sizes are written width x height, as ``hf-tpu diffuse`` reports the image it wrote.

    Args:
        pipe: a ``DiffusionPipeline`` or ``ModularPipeline``.
        height: the image height asked for, in pixels.
        width: the image width asked for, in pixels.

    Raises:
        ValueError (InvalidArgumentError): a side is not an int, not a multiple of :func:`resolution_limits`'
            ``multiple``, or outside its bounds (the message names the nearest valid sizes); or the pipeline has no
            denoiser.

    Example:
        >>> check_resolution(pipe, 30, 30)  # doctest: +SKIP
        ValueError: StableDiffusion3Pipeline cannot make a 30x30 (width x height) image: ... nearest valid sizes
        (width x height): 28x28, 32x32
    """
    multiple, largest = resolution_limits(pipe)
    problems = []
    for side, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool):
            problems.append(f"{side}={value!r} is not an int")
        elif value < multiple:
            problems.append(f"{side}={value} is below the smallest side, {multiple}")
        elif value % multiple:
            problems.append(f"{side}={value} is not a multiple of {multiple}")
        elif largest is not None and value > largest:
            problems.append(f"{side}={value} is above the largest side, {largest}")
    if not problems:
        return

    def nearest(value: Any) -> list[int]:
        if not isinstance(value, int):
            return [multiple]
        down = max(multiple, value - value % multiple)
        up = down if value % multiple == 0 else down + multiple
        if largest is not None:
            down, up = min(down, largest), min(up, largest)
        return sorted({down, up})

    hs, ws = nearest(height), nearest(width)
    suggestions = ", ".join(f"{w}x{h}" for w in ws for h in hs)
    bound = f" and at most {largest}" if largest is not None else ""
    raise InvalidArgumentError(
        f"{type(pipe).__name__} cannot make a {width}x{height} (width x height) image: {'; '.join(problems)}. Image "
        f"sides must be multiples of {multiple} (the VAE scale times the denoiser's patch size){bound}; "
        f"nearest valid sizes (width x height): {suggestions}."
    )


def _generators(generator: Any) -> list[Any]:
    if generator is None:
        return []
    return list(generator) if isinstance(generator, (list, tuple)) else [generator]


def check_generator(pipe: Any, generator: Any, batch_size: int | None = None) -> None:
    """Raise ``ValueError`` if ``generator`` (one or a list) cannot seed this pipeline's latents.

    A CPU generator always works and gives the same image as the CPU pipeline with the same seed; a generator
    on the pipeline's own device works too. Any other device, a mix of devices, or a list whose length is not
    the batch size is refused with a message that says how to make a suitable one.

    Args:
        pipe: the pipeline (its execution device is the one allowed besides the CPU).
        generator: a ``torch.Generator``, a list of them, or None (nothing to check).
        batch_size: the number of images of the call; None (the default) skips the list-length check.

    Raises:
        TypeError (InvalidTypeError): an element is not a ``torch.Generator``.
        ValueError (InvalidArgumentError): a generator on another device than the CPU or the pipeline's, generators on
            mixed devices, or a list whose length is neither 1 nor ``batch_size``.

    Example:
        >>> check_generator(pipe, torch.Generator("cpu").manual_seed(0))  # doctest: +SKIP
    """
    import torch

    gens = _generators(generator)
    if not gens:
        return
    for g in gens:
        if not isinstance(g, torch.Generator):
            raise InvalidTypeError(
                f"generator must be a torch.Generator or a list of them, got {type(g).__name__}: pass "
                f"torch.Generator('cpu').manual_seed(seed)."
            )
    device = torch.device(pipe._execution_device if hasattr(pipe, "_execution_device") else pipe.device)
    allowed = {"cpu", device.type}
    found = sorted({g.device.type for g in gens})
    bad = [d for d in found if d not in allowed]
    if bad or len(found) > 1:
        raise InvalidArgumentError(
            f"{type(pipe).__name__} runs on {device} but got a generator on {', '.join(str(g.device) for g in gens)}"
            f": use torch.Generator('cpu').manual_seed(seed) (the latents are drawn on the host and copied, so the "
            f"image equals the CPU run with that seed){'' if device.type == 'cpu' else f' or a generator on {device}'}"
            f", and the same device for every generator in a list."
        )
    if batch_size is not None and isinstance(generator, (list, tuple)) and len(gens) not in (1, batch_size):
        raise InvalidArgumentError(
            f"got a list of {len(gens)} generators for a batch of {batch_size} images: pass one generator, or one "
            f"per image (batch size = number of prompts x num_images_per_prompt)."
        )


def _tensors(module: Any) -> Iterable[tuple[str, Any]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def check_components_on(pipe: Any, device: Any) -> None:
    """Raise ``RuntimeError`` naming every model component that has a tensor off ``device``.

    Args:
        pipe: the pipeline whose ``components`` are checked (modules only).
        device: the device every parameter and buffer should be on (``"tpu"``, ``"tpu:0"``, a ``torch.device``).

    Raises:
        RuntimeError (SetupError): some component has tensors elsewhere (the message names up to three per component
            and how to fix it: remove offloading hooks, use a TPU-supported quantization, or move them yourself).

    Example:
        >>> pipe.to("tpu"); check_components_on(pipe, "tpu")  # doctest: +SKIP
    """
    import torch

    want = torch.device(device)
    stray = []
    for name, component in pipe.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        off = [
            f"{tname} ({t.device})"
            for tname, t in _tensors(component)
            if t.device.type != want.type or (want.index is not None and t.device.index not in (want.index, None))
        ]
        if off:
            more = f" and {len(off) - 3} more" if len(off) > 3 else ""
            stray.append(f"{name} ({type(component).__name__}): {', '.join(off[:3])}{more}")
    if stray:
        raise SetupError(
            f"{type(pipe).__name__}.to({str(want)!r}) left tensors off {want}: " + "; ".join(stray) + ". "
            "These components cannot be moved as they are: remove offloading hooks "
            "(pipe.remove_all_hooks(), module.disable_group_offload()), load quantized models in a TPU-supported "
            "format, or move them yourself and check with hf_tpu.diffusers.check_components_on(pipe, device)."
        )
