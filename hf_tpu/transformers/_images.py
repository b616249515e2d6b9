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

How a model takes its images is one value, its :class:`ImageLayout` (decided once per model by
:func:`image_layout`): the vision graph its images take and in how many rows its prompt's positions are numbered;
every question the loop, the route and warm-up ask of a model's images (:func:`grid_model`, :func:`grid_tower`,
:func:`takes_grid`, :func:`positioned`, :func:`padded`, :func:`mrope_rows`) reads it. Most layouts are read from the
model (its ``get_image_features``' parameters and source, its modules); the families introspection cannot tell
apart are the entries of :data:`LAYOUTS`, the one table of families, so a new family of an existing layout is one
entry there (no other module of hf_tpu asks for a family by its name).

Qwen2-VL and Qwen2.5-VL (:attr:`ImageLayout.GRID`) take their images as patch rows with a grid per image
(``image_grid_thw``) and number their positions from that grid (multimodal rotary positions, three rows: temporal,
height, width). What depends on the grid's values runs on the host, where upstream computes it: the vision tower's
patch positions, its attention's segment bounds and Qwen2.5's window order (``transformers.vision_utils``, handed to
the tower as the precomputed inputs its ``get_vision_*`` helpers accept), and the prompt's three position rows
(upstream's ``generate`` calls the model's ``_prepare_position_ids_for_generation``, ``get_rope_index``, on the host
ids with the grid and ``mm_token_type_ids``, which stay on the host for it). The tower runs as a ``"grid_vision"``
graph keyed by the grids (its per-image attention is one static chunk per image: :class:`Bounds`); the prefill and
decode graphs take the three rows packed with the ids (``"+mrope"`` graphs), so a decode step still sends one
``(batch, 4)`` tensor and reads back the next tokens. Qwen3-VL's family (Qwen3-VL, Qwen3.5, their MoE forms, Cosmos 3
Omni, Qwen4-Exp) numbers its positions the same way; its towers also resample learned position embeddings to each
grid (the gather indices and weights computed on the host: more precomputed inputs) and Qwen3-VL's hands features of
early blocks to the first decoder layers (``deepstack_features``: the ``"grid_vision"`` graph returns them, and the
model's forward adds them at the image tokens in the prefill graph). EXAONE 4.5 (:attr:`ImageLayout.GRID_TOWER`)
has Qwen2.5-VL's tower before a text of one row of positions: its images take the ``"grid_vision"`` graph, the rest is
the plain image loop. LFM3-VL, MiniMax-M3-VL and HyperCLOVA X Vision V2 (:attr:`ImageLayout.GRID_CONSTANTS`) take
patch rows and a grid per image too, to a ``get_image_features`` taking ``image_grid_thw``: the ``"vision"`` graph
with the grid's values as its constants (:func:`grid_constants`), positions in one row.

Gemma 4 and Gemma 4 Unified (:attr:`ImageLayout.POSITIONED`) take each image as patch rows padded to their processor's
length, with each row's (x, y) position (``image_position_ids``, (-1, -1) for padding); upstream's encoder drops the
padding by the positions' values (a boolean mask, then per-image split sizes read back with ``tolist()``), shapes no
compiled graph can know. The rows' real counts are read on the host from the positions (the processor's output, which
stays on the host) and the ``"positioned_vision"`` graph, keyed by them, runs the encoder's own modules up to the padded
features and keeps each image's first ones (the processor puts an image's rows first, so its pooled features come first
too): the features upstream's encoder returns, in one tensor.

Idefics2, Idefics3 and SmolVLM (:attr:`ImageLayout.PADDED`) take each text row's images padded to the most images of a
row, with a mask of each image's real pixels (``pixel_attention_mask``); upstream's encoder drops the padding images by
their pixel values (all zero: a boolean-mask index, a shape no compiled graph can know) and splits the features per row
with ``tolist()``. The real images are found on the host (the processor's output, which stays there), exactly by
upstream's rule (:func:`padded_images`), and the ``"padded_vision"`` graph, keyed by their shape, runs the model's own
vision model and connector on them only: the features upstream's encoder returns per row, in one tensor (the forward
concatenates them anyway).
"""

from __future__ import annotations

import enum
import inspect

from hf_tpu.errors import UserError
from hf_tpu.transformers._graph_key import GraphKind
from hf_tpu.transformers._settings import NotCompilableError, model_state

__all__ = [
    "Bounds",
    "ImageLayout",
    "ImageTokensError",
    "LAYOUTS",
    "NoImagesError",
    "check_image_tokens",
    "encode_images",
    "feature_tokens",
    "grid_model",
    "grid_tower",
    "image_inputs",
    "image_layout",
    "images_problem",
    "mrope_rows",
    "numbers_from_images",
    "padded",
    "padded_images",
    "padded_rule",
    "positioned",
    "positioned_counts",
    "video_inputs",
]

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


class ImageLayout(enum.Enum):
    """How a vision-language model takes its images, which decides how hf_tpu's loop encodes them (the vision graph
    it runs, named below) and in how many rows it numbers the prompt's positions (:attr:`position_rows`). One per
    model, decided once (:func:`image_layout`)."""

    #: patch rows with a grid per image (``image_grid_thw``) to a vision tower (the base model's ``visual``) taking
    #: the grid's precomputed inputs (:func:`grid_inputs`, the ``"grid_vision"`` graph), and the prompt's positions
    #: numbered from the grids in three rows on the host (upstream's ``get_rope_index``): Qwen2-VL's to Qwen3-VL's
    GRID = "grid"
    #: the same tower and graph before a text numbering its positions in one row from the ids: EXAONE 4.5's
    GRID_TOWER = "grid_tower"
    #: patch rows with a grid per image to a ``get_image_features`` taking ``image_grid_thw``, positions in one row:
    #: the ``"vision"`` graph with the grid's values as its constants (:func:`grid_constants`): LFM3-VL's,
    #: MiniMax-M3-VL's, HyperCLOVA X Vision V2's
    GRID_CONSTANTS = "grid_constants"
    #: patch rows padded to the processor's length with each row's position (``image_position_ids``), the
    #: ``"positioned_vision"`` graph: Gemma 4's and Gemma 4 Unified's
    POSITIONED = "positioned"
    #: each text row's images padded with all-zero images, dropped on the host (:func:`padded_images`), the
    #: ``"padded_vision"`` graph: Idefics2's, Idefics3's, SmolVLM's
    PADDED = "padded"
    #: ``get_image_features`` on the processor's tensors as they come, the ``"vision"`` graph: LLaVA's, Gemma 3's,
    #: PaliGemma's, Mistral 3's (with ``image_sizes`` as host integers), ...
    PLAIN = "plain"

    @property
    def grid(self) -> bool:
        """Whether the images come as patch rows with a grid per image (``image_grid_thw``)."""
        return self in (ImageLayout.GRID, ImageLayout.GRID_TOWER, ImageLayout.GRID_CONSTANTS)

    @property
    def position_rows(self) -> int:
        """How many rows of positions the model's rotary embedding reads: 3 (multimodal rotary positions) for
        :attr:`GRID`, whose ``generate`` numbers every call's prompt in three rows, with or without images; else 1."""
        return 3 if self is ImageLayout.GRID else 1


#: The one table of vision-language families: ``model_type`` -> layout, for the families whose layout introspection
#: cannot tell (:func:`image_layout` reads every other one from the model). A new family of one of these layouts is
#: its entry here, and nothing else: the warm-up (``_mm_warmup``), the vision graphs (``_graphs``), the prompt's
#: positions (the loops, ``_upstream``) and Qwen3-VL's deepstack (``_deepstack``) read the layout or the model, never
#: the family. The grid layouts run the base model's ``visual`` (an entry's family without one is read as unlisted).
#: The :attr:`~ImageLayout.GRID` families' towers accept the grid's precomputed inputs and their ``get_rope_index``
#: numbers text and images from the ids, the token types and the grids on the host: introspection cannot tell them
#: from other models with a ``get_rope_index`` taking the grid (GLM-4V's, ERNIE 4.5 VL's), whose images run upstream's
#: loop (:func:`images_problem`).
LAYOUTS: dict[str, ImageLayout] = {
    # Qwen2-VL and Qwen2.5-VL
    "qwen2_vl": ImageLayout.GRID,
    "qwen2_5_vl": ImageLayout.GRID,
    # Qwen3-VL's family (towers resampling learned position embeddings to each grid; Qwen3-VL's hands features of
    # early blocks to the text: deepstack): Qwen3-VL and its MoE, Qwen3.5 and its MoE, Qwen4-Exp, Cosmos 3 Omni
    "qwen3_vl": ImageLayout.GRID,
    "qwen3_vl_moe": ImageLayout.GRID,
    "qwen3_5": ImageLayout.GRID,
    "qwen3_5_moe": ImageLayout.GRID,
    "qwen4_exp": ImageLayout.GRID,
    "cosmos3_omni": ImageLayout.GRID,
    # EXAONE 4.5: Qwen2.5-VL's tower (axial rotary positions) before a text of one row of positions
    "exaone4_5": ImageLayout.GRID_TOWER,
}


def image_layout(model) -> ImageLayout | None:
    """How ``model`` takes its images (None: its base model has no image encoder, ``get_image_features``, and its
    family is not listed), decided at the first ask and kept in the model's state: a listed family's layout
    (:data:`LAYOUTS`); else read from its image encoder: ``image_position_ids`` taken by modules the
    ``"positioned_vision"`` graph runs (:attr:`ImageLayout.POSITIONED`), padding images dropped by their pixel values
    (:attr:`ImageLayout.PADDED`), ``image_grid_thw`` taken (:attr:`ImageLayout.GRID_CONSTANTS`), else
    :attr:`ImageLayout.PLAIN`."""
    state = model_state(model)
    if not state.image_layout:
        state.image_layout = (_read_layout(model),)
    return state.image_layout[0]


def _read_layout(model) -> ImageLayout | None:
    listed = LAYOUTS.get(getattr(model.config, "model_type", None))
    if listed is not None and hasattr(model.base_model, "visual"):
        return listed
    fn = _encoder_fn(model)
    if fn is None:
        return None
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ImageLayout.PLAIN
    if "image_position_ids" in params and _positioned_modules(model):
        return ImageLayout.POSITIONED
    if "pixel_attention_mask" in params and _PADDED_DROP in _encoder_source(model):
        return ImageLayout.PADDED
    return ImageLayout.GRID_CONSTANTS if "image_grid_thw" in params else ImageLayout.PLAIN


def grid_model(model) -> bool:
    """Whether ``model``'s images come as patch rows with a grid per image and its positions are numbered from those
    grids (:attr:`ImageLayout.GRID`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL's family), which the loop serves."""
    return image_layout(model) is ImageLayout.GRID


def grid_tower(model) -> bool:
    """Whether ``model``'s images come as patch rows with a grid per image to a vision tower that takes the grid's
    precomputed inputs (:func:`grid_inputs`): :attr:`ImageLayout.GRID` and :attr:`ImageLayout.GRID_TOWER`."""
    return image_layout(model) in (ImageLayout.GRID, ImageLayout.GRID_TOWER)


def takes_grid(model) -> bool:
    """Whether the model's image encoder takes its images as patch rows with a grid per image (``get_image_features``
    takes ``image_grid_thw``: LFM3-VL, MiniMax-M3-VL, HyperCLOVA X Vision V2 as well as Qwen2-VL) and numbers the
    prompt's positions in one row (not :func:`grid_tower`'s, whose towers take the grid's precomputed inputs): its
    vision graph takes the grid as constants (:func:`encode_images`); :attr:`ImageLayout.GRID_CONSTANTS`."""
    return image_layout(model) is ImageLayout.GRID_CONSTANTS


def positioned(model) -> bool:
    """Whether the model's image encoder takes its images as patch rows with each row's position
    (``image_position_ids``) and is one the ``"positioned_vision"`` graph runs (:attr:`ImageLayout.POSITIONED`)."""
    return image_layout(model) is ImageLayout.POSITIONED


def _positioned_modules(model) -> bool:
    """Whether the base model has the modules the ``"positioned_vision"`` graph runs: Gemma 4's (a vision tower with
    a patch embedder, an encoder and a pooler, then ``embed_vision``) or Gemma 4 Unified's (an encoder-free
    ``embed_vision`` taking the rows and positions)."""
    base = model.base_model
    tower = getattr(base, "vision_tower", None)
    if tower is not None:
        return all(hasattr(tower, k) for k in ("patch_embedder", "encoder", "pooler")) and hasattr(base, "embed_vision")
    embed = getattr(base, "embed_vision", None)
    try:
        return embed is not None and "image_position_ids" in inspect.signature(embed.forward).parameters
    except (TypeError, ValueError):
        return False


# Upstream's lines of an image encoder that drops padding images by their pixel values (Idefics2's, Idefics3's and
# SmolVLM's ``get_image_features``), whitespace removed: the drop itself; each patch's mask from its pixels' (Idefics2:
# every pixel of the patch real; Idefics3, SmolVLM: any pixel real); SmolVLM's "if no images, leave one empty image".
_PADDED_DROP = "real_images_inds=(pixel_values==0.0).sum(dim=(-1,-2,-3))!=nb_values_per_image"
_PADDED_FULL = "patch_attention_mask=(patches_subgrid.sum(dim=(-1,-2))==patch_size*patch_size).bool()"
_PADDED_ANY = "patch_attention_mask=(patches_subgrid.sum(dim=(-1,-2))>0).bool()"
_PADDED_KEEP_ONE = "real_images_inds[0]|=~torch.any(real_images_inds)"


_SOURCES: dict[type, str] = {}


def _encoder_source(model) -> str:
    """The source of the base model's ``get_image_features`` (decorators unwrapped), whitespace removed, read once per
    class; empty when it has none or its source cannot be read."""
    cls = type(model.base_model)
    if cls not in _SOURCES:
        fn = getattr(cls, "get_image_features", None)
        try:
            _SOURCES[cls] = "".join(inspect.getsource(inspect.unwrap(fn)).split()) if fn is not None else ""
        except (OSError, TypeError):
            _SOURCES[cls] = ""
    return _SOURCES[cls]


def padded(model) -> bool:
    """Whether the model's image encoder takes each text row's images padded with all-zero images and a mask of their
    real pixels (``pixel_attention_mask``) and drops the padding images by their pixel values
    (:attr:`ImageLayout.PADDED`: Idefics2's, Idefics3's and SmolVLM's family; :func:`padded_rule` says whether the
    ``"padded_vision"`` graph knows its rules)."""
    return image_layout(model) is ImageLayout.PADDED


def padded_rule(model) -> dict | None:
    """The rules of a :func:`padded` model's encoder, read from its source: ``full`` (a patch is real when every pixel
    of it is: Idefics2's; else when any is: Idefics3's, SmolVLM's), ``keep_one`` (with no real image, the first one is
    kept: SmolVLM's), ``connector_mask`` (its connector takes the patches' mask: Idefics2's perceiver). None when the
    encoder is none of these (another rule, or modules other than ``vision_model`` and ``connector``)."""
    source = _encoder_source(model)
    base = model.base_model
    full, any_ = _PADDED_FULL in source, _PADDED_ANY in source
    if full == any_ or not all(hasattr(base, k) for k in ("vision_model", "connector")):
        return None
    if "self.vision_model(pixel_values=pixel_values,patch_attention_mask=patch_attention_mask" not in source:
        return None
    try:
        takes_mask = "attention_mask" in inspect.signature(base.connector.forward).parameters
    except (TypeError, ValueError):
        return None
    calls_with_mask = "self.connector(image_hidden_states,attention_mask=patch_attention_mask.view(" in source
    if takes_mask != calls_with_mask or (not calls_with_mask and "self.connector(image_hidden_states)" not in source):
        return None
    return {"full": full, "keep_one": _PADDED_KEEP_ONE in source, "connector_mask": calls_with_mask}


def padded_images(model, pixels, mask):
    """The real images of a :func:`padded` model's call and their pixel masks, on the host, by upstream's rule (its
    ``get_image_features``: the pixels cast to the model's dtype, an image all of whose values are zero is padding;
    SmolVLM's keeps the first image when none is real; no mask given: every pixel real), and the real images per text
    row (host ints). ``pixels``: ``(rows, images, channels, height, width)``; ``mask``: ``(rows, images, height,
    width)`` or None."""
    import torch

    rule = padded_rule(model)
    rows, count = int(pixels.shape[0]), int(pixels.shape[1])
    pixels = pixels.to("cpu").to(dtype=model.base_model.dtype)
    pixels = pixels.reshape(rows * count, *pixels.shape[2:])
    real = (pixels == 0.0).sum(dim=(-1, -2, -3)) != pixels.shape[1:].numel()
    if rule is not None and rule["keep_one"]:
        real[0] |= ~torch.any(real)
    counts = tuple(int(n) for n in real.view(rows, count).sum(dim=1).tolist())
    pixels = pixels[real].contiguous()
    if mask is None:
        mask = torch.ones(pixels.shape[0], pixels.shape[2], pixels.shape[3], dtype=torch.bool)
    else:
        mask = mask.to("cpu").reshape(rows * count, *mask.shape[2:])[real].contiguous()
    return pixels, mask, counts


def positioned_counts(model, positions) -> tuple[int, ...]:
    """Each image's real patch rows (its positions other than (-1, -1)), read on the host; the features each one
    gives are these over the pooling kernel's area (Gemma 4's) or these (Gemma 4 Unified's, a row per token)."""
    real = (positions.to("cpu") != -1).all(dim=-1).sum(dim=-1)
    return tuple(int(n) for n in real.tolist())


def numbers_from_images(model) -> bool:
    """Whether ``model`` numbers its positions from its images (multimodal rotary positions: a ``get_rope_index``
    over the images' grids, Qwen2-VL's to Qwen3-VL's, or a forward taking ``rope_deltas``)."""
    forward = getattr(model, "forward", None)
    try:
        params = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        params = {}
    return hasattr(model.base_model, "get_rope_index") or "rope_deltas" in params


def mrope_rows(model) -> int:
    """How many rows of positions the model's rotary embedding reads (:attr:`ImageLayout.position_rows`: 3 for the
    multimodal rotary positions of :attr:`ImageLayout.GRID`'s, whose ``generate`` numbers every call's prompt, with
    or without images, in three rows); 1 for every other model."""
    layout = image_layout(model)
    return 1 if layout is None else layout.position_rows


def video_inputs(model, model_kwargs: dict) -> list[str]:
    """The names of the call's inputs that upstream hands the video encoder (``get_video_features``'s arguments among
    ``model_kwargs``, given and not None: Qwen2-VL's ``pixel_values_videos`` and ``video_grid_thw``)."""
    fn = getattr(model.base_model, "get_video_features", None)
    try:
        params = inspect.signature(fn).parameters if fn is not None else {}
    except (TypeError, ValueError):
        return []
    return [k for k in params if k != "kwargs" and model_kwargs.get(k) is not None]


def images_problem(model, model_kwargs: dict) -> str | None:
    """Why hf_tpu's cached loop cannot take this call's images (None when it can)."""
    name = type(model).__name__
    if "image" not in getattr(model, "input_modalities", ()) or not model._supports_mm_encoder_outputs():
        return f"images: {name}'s forward takes no pre-encoded images (mm_encoder_outputs)"
    layout = image_layout(model)
    if layout is ImageLayout.GRID and model_kwargs.get("image_grid_thw") is None:
        return f"images: {name} takes its images' grid (image_grid_thw) with them, and the call gave none"
    if layout is not ImageLayout.GRID and numbers_from_images(model):
        numbered = ", ".join(family for family, listed in LAYOUTS.items() if listed is ImageLayout.GRID)
        return (
            f"images: {name} numbers its positions from the images (multimodal rotary positions, get_rope_index over "
            f"the image grid), which the bucketed loop builds for {numbered} only"
        )
    if layout is ImageLayout.GRID_CONSTANTS and model_kwargs.get("image_grid_thw") is None:
        return f"images: {name} takes its images' grid (image_grid_thw) with them, and the call gave none"
    if layout is ImageLayout.PADDED and padded_rule(model) is None:
        return (
            f"images: {name}'s image encoder drops padding images by their pixel values with rules hf_tpu does not "
            "know (a patch's mask neither 'every pixel real' as Idefics2's nor 'any pixel real' as Idefics3's, or "
            "modules other than vision_model and connector), so its vision graph cannot leave them out on the host"
        )
    video = [k for k in model_kwargs if "video" in k and model_kwargs[k] is not None]
    if video:
        return f"videos ({', '.join(video)}) are not supported by the bucketed loop yet"
    return None


# Image inputs that give each image's size in pixels (LLaVA-NeXT's and Mistral 3's ``image_sizes``, ``(images, 2)``):
# the encoder shapes its tensors by their values (tiles per image, the unpadded feature grid, the crop of each image),
# which a compiled graph cannot read from a tensor; handed over as host integers (as upstream's helpers accept them)
# they are constants of the vision graph, keyed by them.
_SIZES = ("image_sizes",)


def encode_images(model, state, model_kwargs: dict, run) -> dict:
    """``model_kwargs`` with its image inputs replaced by ``mm_encoder_outputs={"image": ...}``: the base model's
    ``get_image_features`` run as a compiled graph (``run``: :func:`hf_tpu.transformers._graphs.run_graph`) on the
    inputs moved to the model's device, keyed by the shapes of its tensor inputs."""
    import torch

    layout = image_layout(model)
    if layout in (ImageLayout.GRID, ImageLayout.GRID_TOWER):
        return _encode_grid_images(model, state, model_kwargs, run)
    if layout is ImageLayout.POSITIONED:
        return _encode_positioned_images(model, state, model_kwargs, run)
    if layout is ImageLayout.PADDED:
        return _encode_padded_images(model, state, model_kwargs, run)
    names = image_inputs(model, model_kwargs)
    kwargs = dict(model_kwargs)
    inputs = {}
    grid = kwargs.pop("image_grid_thw", None) if layout is ImageLayout.GRID_CONSTANTS else None
    for name in names:
        if name == "image_grid_thw" and grid is not None:  # (popped above: the graph's constants)
            continue
        value = kwargs.pop(name)
        if name in _SIZES and isinstance(value, torch.Tensor):
            value = value.tolist()  # (host integers: constants of the graph, which its key names)
        inputs[name] = value.to(model.device) if isinstance(value, torch.Tensor) else value
    shapes = tuple(
        (name, tuple(v.shape)) if isinstance(v, torch.Tensor) else (name, repr(v)) for name, v in inputs.items()
    )
    key = (GraphKind("vision"), int(next(v for k, v in inputs.items() if k in _PIXEL_NAMES).shape[0]), shapes)
    if grid is not None:  # the grid's values: constants of the graph (keyed by them), with what upstream reads of them
        constants = grid_constants(model, grid)
        # (per image count)
        key = (GraphKind("vision"), len(constants["image_grid_thw"]), shapes, constants["image_grid_thw"])
        tower = next((m for m in model.base_model.children() if hasattr(m, "window_size")), None)
        args = (inputs, constants, {**_window_inputs(tower, grid, model.device), **_position_inputs(model, grid)})
    else:
        args = (inputs,)
    with torch.no_grad():
        encoded = run(model, state, key, *args)
    kwargs["mm_encoder_outputs"] = {"image": encoded}
    return kwargs


class NoImagesError(UserError, ValueError):
    """A call whose images are all padding to a model whose image encoder drops padding images (Idefics2's,
    Idefics3's) and then has none to encode."""


class ImageTokensError(UserError, ValueError):
    """A prompt whose image tokens do not match its encoded images' features in number."""


def image_token_id(model) -> int | None:
    """The model's image token (``image_token_id`` or ``image_token_index`` of its config); None when it names none."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(model.config, name, None)
        if isinstance(value, int):
            return value
    return None


def feature_tokens(model, encoded) -> int:
    """How many prompt tokens the encoded images fill: their features' elements over the text's hidden size."""
    import torch

    pooled = getattr(encoded, "pooler_output", encoded)
    tensors = pooled if isinstance(pooled, (list, tuple)) else [pooled]
    hidden = int(model.config.get_text_config(decoder=True).hidden_size)
    return sum(int(t.numel()) for t in tensors if isinstance(t, torch.Tensor)) // hidden


def check_image_tokens(model, input_ids, mm_encoder_outputs) -> None:
    """Upstream's check that the prompt holds one image token per feature row of its encoded images (the forward's
    ``get_placeholder_mask``), run on the host ids: in the prefill graph it is a read of a device value on the host,
    which torch_tpu refuses to lower, so the ``mm_prefill`` graphs are traced without it (``_graphs.run_graph``).

    Raises:
        ImageTokensError: the counts differ (upstream raises ``ValueError`` with its own message then)."""
    token = image_token_id(model)
    if token is None:
        return
    expected = feature_tokens(model, mm_encoder_outputs["image"])
    found = int((input_ids.to("cpu") == token).sum())
    if found != expected:
        raise ImageTokensError(
            f"image features and image tokens do not match: the prompt holds {found} image token(s) (id {token}) and "
            f"its images fill {expected}; build the prompt with the model's processor, which puts one image token "
            "per feature row"
        )


def features_shape(mm_encoder_outputs) -> tuple:
    """The shapes of the encoded images' tensors (a prefill graph's key: the merge is compiled for them)."""
    import torch

    encoded = mm_encoder_outputs["image"]
    shapes = []

    def add(value):
        if isinstance(value, torch.Tensor):
            shapes.append(tuple(value.shape))
        elif isinstance(value, (list, tuple)):  # (per image; per layer and image for deepstack features)
            for item in value:
                add(item)

    for value in encoded.values() if hasattr(encoded, "values") else [encoded]:
        add(value)
    return tuple(shapes)


class Bounds:
    """The segment bounds of a vision tower's packed attention (``cu_seqlens``: one segment per image frame) as host
    integers. Upstream's towers take them precomputed, and the attention they run off flash kernels cuts its
    sequence at them (``(bounds[1:] - bounds[:-1]).tolist()``): read from a tensor, those lengths would be values
    the compiled graph cannot know; from this object they are constants of the graph (keyed by the grids), and each
    image is attended on its own exactly as upstream does."""

    def __init__(self, values):
        self.values = tuple(int(v) for v in values)

    def __getitem__(self, index):
        return Bounds(self.values[index])

    def __sub__(self, other):
        return Bounds([a - b for a, b in zip(self.values, other.values)])

    def tolist(self) -> list[int]:
        return list(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        return f"Bounds({list(self.values)})"


def grid_inputs(model, grid) -> dict:
    """The vision tower's precomputed inputs for the images of ``grid`` (``image_grid_thw`` on the host), computed on
    the host with upstream's own helpers: the patches' rotary positions (on the model's device), the attention's
    segment bounds (:class:`Bounds`), for a tower with window attention (Qwen2.5-VL) the window order (on the
    device) and the windows' bounds, and for a tower resampling learned position embeddings (Qwen3-VL's family)
    their gather indices and weights (:func:`_interpolation_inputs`)."""
    from transformers import vision_utils

    visual = model.base_model.visual
    merge = int(visual.spatial_merge_size)
    grid = grid.to("cpu").long()
    inputs = {
        "position_ids": vision_utils.get_vision_position_ids(grid, merge).to(model.device),
        "cu_seqlens": Bounds(vision_utils.get_vision_cu_seqlens(grid).tolist()),
    }
    inputs.update(_window_inputs(visual, grid, model.device))
    inputs.update(_interpolation_inputs(visual, grid, model.device))
    return inputs


def _interpolation_inputs(tower, grid, device) -> dict:
    """The gather indices and weights (on ``device``) with which a vision tower resamples its square table of learned
    position embeddings to each image's grid (Qwen3-VL's family: ``num_grid_per_side``), computed on the host with
    upstream's ``get_vision_interpolation_indices_and_weights`` as the tower calls it; empty for a tower without
    such a table."""
    from transformers import vision_utils

    side = getattr(tower, "num_grid_per_side", None)
    if not isinstance(side, int):
        return {}
    indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
        grid.to("cpu").long(), num_grid_per_side=side, mode=getattr(tower, "interpolation_mode", "bilinear"),
        align_corners=getattr(tower, "interpolation_align_corners", False),
        spatial_merge_size=int(tower.config.spatial_merge_size),
    )  # fmt: skip
    return {"interp_indices": indices.to(device), "interp_weights": weights.to(device)}


def grid_constants(model, grid) -> dict:
    """The grid of a :func:`takes_grid` model's images (``image_grid_thw``) and its attention's segment bounds
    (upstream's ``get_vision_cu_seqlens``, one segment per frame: every image has one) as nested tuples of ints:
    the vision graph builds its tensors from them, and dynamo knows the values those tensors hold (a tower reads
    them back with ``tolist()`` to size its per-image splits; from a graph input they would be unknown values)."""
    from transformers import vision_utils

    grid = grid.to("cpu").long()
    return {
        "image_grid_thw": tuple(tuple(int(n) for n in row) for row in grid.tolist()),
        "cu_seqlens": tuple(int(n) for n in vision_utils.get_vision_cu_seqlens(grid).tolist()),
    }


def _window_inputs(tower, grid, device) -> dict:
    """A windowed vision tower's precomputed window order (on ``device``) and windows' bounds (as :class:`Bounds`),
    computed on the host with upstream's ``get_vision_window_index`` (Qwen2.5-VL's tower, which EXAONE 4.5 and
    HyperCLOVA X Vision V2 use); empty for a tower without windows (or none)."""
    from transformers import vision_utils

    if tower is None or not hasattr(tower, "window_size"):
        return {}
    index, bounds = vision_utils.get_vision_window_index(
        grid.to("cpu").long(), spatial_merge_size=int(tower.spatial_merge_size), window_size=tower.window_size,
        patch_size=tower.patch_size,
    )  # fmt: skip
    return {"window_index": index.to(device), "cu_window_seqlens": Bounds(bounds.tolist())}


def _position_inputs(model, grid) -> dict:
    """The patches' rotary positions of a :func:`takes_grid` model's tower that numbers them with upstream's
    ``get_vision_position_ids(grid_thw, self.spatial_merge_size, kwargs=kwargs)`` (LFM3-VL's, Qwen2.5-VL's in
    HyperCLOVA X Vision V2), computed on the host and moved to the model's device, as that helper accepts them
    precomputed: in the graph it builds a tensor of the merge size and reads it back (``tolist()``), a read of a device
    value on the host that torch_tpu refuses to lower. Empty for another tower."""
    from transformers import vision_utils

    for tower in model.base_model.children():
        merge = getattr(tower, "spatial_merge_size", None)
        try:
            source = inspect.getsource(type(tower).forward) if isinstance(merge, int) else ""
        except (OSError, TypeError):
            source = ""
        if "get_vision_position_ids(grid_thw, self.spatial_merge_size, kwargs=kwargs)" in source:
            positions = vision_utils.get_vision_position_ids(grid.to("cpu").long(), merge)
            return {"position_ids": positions.to(model.device)}
    return {}


def _encode_grid_images(model, state, model_kwargs: dict, run) -> dict:
    """:func:`encode_images` for a grid model: the tower on the patch rows as a ``"grid_vision"`` graph keyed by the
    grids; ``image_grid_thw`` (and ``mm_token_type_ids``) stay in the kwargs, on the host, for upstream's
    ``generate`` to number the prompt's positions from."""
    import sys

    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    kwargs = dict(model_kwargs)
    pixels = kwargs.pop("pixel_values")
    grid = kwargs["image_grid_thw"].to("cpu").long()
    kwargs["image_grid_thw"] = grid
    if kwargs.get("mm_token_type_ids") is not None:
        kwargs["mm_token_type_ids"] = kwargs["mm_token_type_ids"].to("cpu")
    rows = tuple(tuple(row) for row in grid.tolist())
    key = (GraphKind("grid_vision"), int(grid.shape[0]), tuple(pixels.shape), rows)
    with torch.no_grad():
        merged = run(model, state, key, pixels.to(model.device), grid_inputs(model, grid))
    # (the forward concatenates the images' features before merging them: one tensor holds them all)
    if isinstance(merged, tuple):  # with the features of the tower's early layers, per text layer (deepstack)
        merged, deepstack = merged
        output = sys.modules[type(model.base_model).__module__].BaseModelOutputWithDeepstackFeatures
        encoded = output(pooler_output=(merged,), deepstack_features=[(layer,) for layer in deepstack])
    else:
        encoded = BaseModelOutputWithPooling(pooler_output=(merged,))
    kwargs["mm_encoder_outputs"] = {"image": encoded}
    if image_layout(model) is not ImageLayout.GRID:  # (one row of positions, from the ids: the grids served the tower)
        kwargs.pop("image_grid_thw")
    return kwargs


def _encode_positioned_images(model, state, model_kwargs: dict, run) -> dict:
    """:func:`encode_images` for a :func:`positioned` model: the ``"positioned_vision"`` graph on the patch rows and
    positions, keyed by their shapes and each image's real row count (host integers, constants of the graph)."""
    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    kwargs = dict(model_kwargs)
    pixels, positions = kwargs.pop("pixel_values"), kwargs.pop("image_position_ids")
    counts = positioned_counts(model, positions)
    key = (GraphKind("positioned_vision"), int(pixels.shape[0]), tuple(pixels.shape), counts)
    with torch.no_grad():
        features = run(model, state, key, pixels.to(model.device), positions.to(model.device), counts)
    # (the forward concatenates the images' features before merging them: one tensor holds them all)
    kwargs["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=(features,))}
    return kwargs


def _encode_padded_images(model, state, model_kwargs: dict, run) -> dict:
    """:func:`encode_images` for a :func:`padded` model: the padding images dropped on the host
    (:func:`padded_images`), then the ``"padded_vision"`` graph on the real ones, keyed by their shape and their
    mask's dtype (the per-row counts shape nothing: the forward concatenates the rows' features)."""
    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    rule = padded_rule(model)
    if rule is None:  # (images_problem sends such calls to upstream's loop first, and warm-up refuses them)
        state.images_problem = images_problem(model, model_kwargs)
        raise NotCompilableError(state.images_problem)
    kwargs = dict(model_kwargs)
    pixels, mask, _ = padded_images(model, kwargs.pop("pixel_values"), kwargs.pop("pixel_attention_mask", None))
    if pixels.shape[0] == 0:  # (Idefics2's, Idefics3's rule: upstream's encoder fails too, reshaping no features)
        raise NoImagesError(
            f"every image given to {type(model).__name__} is all zero, which its image encoder drops as padding, and "
            "it then has no image to encode (upstream's get_image_features fails on it as well): leave pixel_values "
            "out of a call without images"
        )
    dtype = str(mask.dtype).removeprefix("torch.")
    key = (GraphKind("padded_vision"), int(pixels.shape[0]), tuple(pixels.shape), dtype)
    with torch.no_grad():
        rules = (rule["full"], rule["connector_mask"])  # (constants of the graph: the model's own)
        features = run(model, state, key, pixels.to(model.device), mask.to(model.device), rules)
    kwargs["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=(features,))}
    return kwargs
