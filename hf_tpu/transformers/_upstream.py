"""What upstream transformers takes and does, read from the installed version: the names it passes a model's cache
by, what a call asks for that only upstream's loop does (:func:`call_problem`), and running that loop on a TPU.

**Upstream's names.** transformers 5.24 renamed the cache a model's forward takes, the field of its output that
returns it, and the field of ``generate``'s output, from ``past_key_values`` (5.23) to ``cache``. A forward that also
takes ``**kwargs`` swallows the name it does not know without a word: given ``cache=`` under 5.23, a Llama runs
without a cache, and the probe that measures what a forward writes would find nothing written and send every call to
the slower loop without a cache. So every call and probe that hands a forward its cache takes the name from here:
:func:`cache_name` reads it from upstream's own ``GenerationMixin.prepare_inputs_for_generation`` (the method that
builds the forward's inputs in ``generate``), and raises :class:`UpstreamSignatureError` when that signature does not
tell (neither name, or both); :func:`model_cache_problem` names a model whose forward takes the other name,
:func:`output_cache_field` the field of an output class that holds the cache. Tested with transformers 5.23.0
(``past_key_values``) and 5.25.0 (``cache``): ``.ci/run`` runs the generation tier on the oldest version
``pyproject.toml`` declares, the README's command on the newest.

**Upstream's loop.** Anything hf_tpu's loops do not cover (assisted decoding, beam search the beam loop cannot
serve, a user cache it cannot copy in, extra model inputs, non-static ``cache_implementation``, ...) runs upstream's
code unchanged, its inputs moved to the TPU as upstream's own ``prepare_inputs_for_generation`` moves them
(:func:`inputs_on_model_device`). The route of a call (which loop, and why) is decided in
:mod:`hf_tpu.transformers.route`, which asks this module about the call's arguments and the model's class
(:func:`call_problem`, :func:`inputs_problem`, :func:`own_generate`, :func:`numbers_by_cache_length`,
:func:`model_cache_problem`). ``_UPSTREAM_GENERATE`` is the original ``GenerationMixin.generate``, set by
:mod:`hf_tpu.transformers._integration`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator

from hf_tpu.errors import HfTpuError
from hf_tpu.transformers._images import grid_model, numbers_from_images, positioned
from hf_tpu.transformers._settings import DEVICE_TYPES, Layout

__all__ = ["CACHE_NAMES", "UpstreamSignatureError", "cache_name", "model_cache_problem", "output_cache_field"]

# The cache's name, newest first: 5.24 and later, then 5.23.
CACHE_NAMES = ("cache", "past_key_values")

_NAME: str | None = None  # (read once by cache_name)


class UpstreamSignatureError(HfTpuError, TypeError):
    """The installed transformers' signatures do not say a name hf_tpu needs (the message names which, and where)."""


def _named(params, where: str) -> str | None:
    found = [name for name in CACHE_NAMES if name in params]
    if len(found) > 1:
        raise UpstreamSignatureError(
            f"{where} takes both {found[0]!r} and {found[1]!r}: hf_tpu cannot tell which one is the cache. Install a "
            "transformers release hf_tpu supports (pyproject.toml's range) or report the version to hf_tpu."
        )
    return found[0] if found else None


def cache_name() -> str:
    """The name the installed transformers passes a model's cache by (``"cache"`` on 5.24+, ``"past_key_values"``
    on 5.23), read once from ``GenerationMixin.prepare_inputs_for_generation``.

    Raises:
        UpstreamSignatureError: that signature names neither or both.
    """
    global _NAME
    if _NAME is None:
        from transformers.generation.utils import GenerationMixin

        where = "transformers' GenerationMixin.prepare_inputs_for_generation"
        params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
        name = _named(params, where)
        if name is None:
            import transformers

            raise UpstreamSignatureError(
                f"{where} (transformers {transformers.__version__}) takes neither 'cache' nor 'past_key_values': "
                "hf_tpu cannot tell how to hand a forward its cache. Install a transformers release hf_tpu supports "
                "(pyproject.toml's range)."
            )
        _NAME = name
    return _NAME


def model_cache_problem(model) -> str | None:
    """Why hf_tpu's cached loop cannot hand ``model``'s forward its cache (a forward that names the cache otherwise
    than the installed transformers does: a model class from another version's code); None when it can."""
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return None
    own = _named(params, f"{type(model).__name__}.forward")
    expected = cache_name()
    if own is not None and own != expected:
        return (
            f"{type(model).__name__}.forward takes its cache as {own!r} where the installed transformers passes "
            f"{expected!r} (a model class written for another transformers version)"
        )
    return None


def output_cache_field(output_class) -> str:
    """The field of ``output_class`` (a ``ModelOutput`` dataclass: a forward's or ``generate``'s output) that holds
    the cache.

    Raises:
        UpstreamSignatureError: the class has neither field.
    """
    fields = getattr(output_class, "__dataclass_fields__", {})
    for name in CACHE_NAMES:
        if name in fields:
            return name
    raise UpstreamSignatureError(
        f"{output_class.__name__} has no field named {' or '.join(map(repr, CACHE_NAMES))}: hf_tpu cannot return the "
        "cache in it. Install a transformers release hf_tpu supports (pyproject.toml's range)."
    )


_UPSTREAM_GENERATE: Callable | None = None
_SUPPORTED_MODEL_KWARGS = {"attention_mask", "position_ids", "use_cache", "input_ids", *CACHE_NAMES}
# (upstream keeps these in the model kwargs too; the generation config's flags are what the loops read)
_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states")


def upstream_generate() -> Callable:
    if _UPSTREAM_GENERATE is not None:
        return _UPSTREAM_GENERATE
    from transformers.generation.utils import GenerationMixin

    fn = GenerationMixin.generate
    return getattr(fn, "__hf_tpu_upstream__", fn)


def call_problem(model, args: dict, config) -> tuple[str, bool] | None:
    """Why this call runs upstream's loop whatever the model's route (what its arguments and generation config
    ``config``, as upstream prepares it, ask for that only upstream's loop does), and whether ``generate`` warns (a
    cost on a TPU); None when one of hf_tpu's loops may serve it. :mod:`hf_tpu.transformers.route` asks it first, then
    whether a cache the call gives can be copied in (:mod:`hf_tpu.transformers._cache.handoff`), then
    :func:`inputs_problem`."""
    from transformers.generation.configuration_utils import GenerationMode

    if args.get("custom_generate") is not None:
        return "custom_generate given", False
    for name in ("assistant_model", "negative_prompt_ids", "prefix_allowed_tokens_fn"):
        if args.get(name) is not None:
            return f"{name} is not supported by the bucketed loop", True
    if args.get("synced_gpus"):
        return "synced_gpus is not supported by the bucketed loop", True
    if config.disable_compile:
        return "disable_compile=True", False
    if config.cache_implementation not in (None, "static"):
        if config.cache_implementation == "dynamic":
            return (
                "cache_implementation='dynamic' on a TPU grows the cache by one token per step: every decode step has "
                "a new shape and compiles a new program (max_new_tokens=N costs about N compiles). Drop "
                "cache_implementation to get hf_tpu's static, bucketed cache"
            ), True
        return f"cache_implementation={config.cache_implementation!r} is not supported by the bucketed loop", True
    if not config.use_cache and model.config.is_encoder_decoder:
        return "use_cache=False recomputes the whole sequence each step, a new shape (and compile) per step", True
    mode = config.get_generation_mode(args.get("assistant_model"))
    served = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE)
    if mode not in served:  # (beam search: hf_tpu.transformers.route asks hf_tpu.transformers._loops.beam)
        return (
            f"{mode.value} is not supported by the bucketed loop (only greedy search, sampling, beam search and beam "
            "sampling are)"
        ), True
    if (config.output_attentions or config.output_hidden_states) and model.config.is_encoder_decoder:
        asked = [n for n in ("output_attentions", "output_hidden_states") if getattr(config, n, False)]
        return (
            f"{'/'.join(asked)}=True on an encoder-decoder model: hf_tpu's graphs return every layer's attentions "
            "and hidden states for decoder-only models only (not the encoder's and cross-attention ones yet)"
        ), True
    if config.token_healing:
        return "token_healing is not supported by the bucketed loop", True
    return None


def inputs_problem(model, model_kwargs: dict, layout: Layout) -> tuple[str, bool] | None:
    """Why upstream's loop runs a call whose model inputs ``model_kwargs`` include some hf_tpu's loops do not take
    (and that ``generate`` warns); None when they take them all. ``layout``: the call's
    :class:`~hf_tpu.transformers._settings.Layout` (its image inputs, whether the model has an image encoder)."""
    extra = set(model_kwargs) - _SUPPORTED_MODEL_KWARGS - set(PROMPT_INPUTS) - set(_OUTPUT_FLAGS)
    if model.config.is_encoder_decoder:
        extra -= {"decoder_input_ids", encoder_input_name(model)}
    images = layout.images
    extra -= set(images)  # (route.py says whether the cached loop takes them)
    if images and positioned(model):
        # (Gemma 4's processor marks the image tokens: the prefill's forward reads them, for its mask over each image)
        extra -= {"mm_token_type_ids"}
    if layout.vision and (grid_model(model) or (images and numbers_from_images(model))):
        # (upstream's generate numbers the prompt's positions from them, on the host; for a model whose images the
        # loop does not number, route.py says why with the images)
        extra -= {"mm_token_type_ids", "image_grid_thw"}
    extra = {k for k in extra if model_kwargs[k] is not None} - unread_inputs(model, extra)
    if extra:
        return f"model inputs {sorted(extra)} are not supported by the bucketed loop", True
    return None


def unread_inputs(model, names) -> set[str]:
    """The inputs among ``names`` that the model's ``forward`` takes as named parameters and never reads (GLM-5 Next's
    ``mm_token_type_ids``: its processor returns them, its forward accepts and drops them): upstream's loop hands them
    over for nothing, so the bucketed loop may leave them out. Read from the forward's bytecode (decorators unwrapped):
    a parameter no instruction loads, in a function that neither calls ``locals()`` nor hands it to a closure."""
    import dis

    forward = inspect.unwrap(getattr(type(model), "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    if code is None or "locals" in code.co_names or "vars" in code.co_names:
        return set()
    params = set(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]) - set(code.co_cellvars)
    read = set()
    for inst in dis.get_instructions(code):
        if inst.opname.startswith(("LOAD_FAST", "DELETE_FAST", "STORE_FAST")) or inst.opname == "LOAD_DEREF":
            read.update(inst.argval if isinstance(inst.argval, tuple) else (inst.argval,))
    return {name for name in names if name in params and name not in read}


# Prompt inputs besides ids the cached loop takes, where the model's forward does (decoder-only models): the prompt as
# embeddings (its prefill runs on them, left-padded with zero rows), and token types (the prompt's, left-padded with
# 0, then the last one for every new token, as upstream's loop repeats it).
PROMPT_INPUTS = ("inputs_embeds", "token_type_ids")


def prompt_first_inputs(model, given: list[str] | None = None) -> str:
    """The reason a prompt-first model (its prompt before the bucket's padding) runs upstream's loop for ``given``."""
    names = ", ".join(given or PROMPT_INPUTS)
    return (
        f"{names}: {type(model).__name__} places its prompt by its cache length (the prompt first, the bucket's "
        "padding after it), a layout the bucketed loop builds from ids only"
    )


# Set while upstream's loop runs a call hf_tpu routed to it: a generate it calls from there (assisted decoding's
# candidate generator calls the assistant's) runs upstream's loop too (:func:`nested_call`).
_RUNNING: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_tpu_upstream_running", default=False)


def nested_call() -> str | None:
    """Why a ``generate`` called while upstream's loop runs an hf_tpu-routed call runs upstream's loop as well (None
    outside one): the inner call shares the outer one's logits processors (assisted decoding hands the assistant
    its own), which prepare device state on the tensors they first see; hf_tpu's loop would run them on the host
    and leave host tensors in processors upstream's outer loop then runs on the device."""
    if not _RUNNING.get():
        return None
    return (
        "generate called from inside upstream's generate (assisted decoding's candidate generator): it runs "
        "upstream's too"
    )


@contextlib.contextmanager
def running() -> Iterator[None]:
    """While upstream's loop runs a call (see :func:`nested_call`)."""
    token = _RUNNING.set(True)
    try:
        yield
    finally:
        _RUNNING.reset(token)


@contextlib.contextmanager
def inputs_on_model_device(model) -> Iterator[None]:
    """While upstream's loop runs on a TPU-placed ``model``: its ``prepare_inputs_for_generation`` ends by moving
    the forward's inputs onto the model's device, as upstream's own one does (upstream keeps the growing sequence
    on the caller's device, the host here, and moves only what the forward consumes). Upstream's method does
    that as its last step; a model class that overrides it without calling it (XLM, XLNet) would hand the
    forward host tensors. Done on the instance for the call, taken off after; the wrapper keeps the bound method's
    signature (``functools.wraps``), which upstream reads (``generate`` accepts ``inputs_embeds`` only from a class
    whose ``prepare_inputs_for_generation`` names it)."""
    from transformers.generation.utils import GenerationMixin
    from transformers.pytorch_utils import move_to_device

    device = getattr(model, "device", None)
    own = type(model).prepare_inputs_for_generation
    if (
        device is None
        or device.type not in DEVICE_TYPES
        or own is GenerationMixin.prepare_inputs_for_generation
        or "prepare_inputs_for_generation" in vars(model)
    ):
        yield
        return

    bound = own.__get__(model, type(model))

    @functools.wraps(bound)
    def prepare_inputs_for_generation(*args, **kwargs):
        return move_to_device(bound(*args, **kwargs), model.device)

    vars(model)["prepare_inputs_for_generation"] = prepare_inputs_for_generation
    try:
        yield
    finally:
        vars(model).pop("prepare_inputs_for_generation", None)


def encoder_input_name(model) -> str | None:
    """The name of the encoder input of an encoder-decoder ``model`` whose encoder takes features rather than token
    ids (Whisper's and Speech2Text's ``input_features``: a float tensor whose length the model fixes, or its feature
    extractor pads to); None for token ids or a decoder-only model. Read from the class's ``main_input_name``."""
    if not model.config.is_encoder_decoder:
        return None
    name = getattr(model, "main_input_name", "input_ids")
    return None if name == "input_ids" else name


def numbers_by_cache_length(model) -> bool:
    """A decoder-only model with absolute position embeddings whose forward takes no ``position_ids`` (Bart-family
    and Whisper decoders, TrOCR, ...): it numbers the prompt's tokens from the cache length, so pads before a prompt
    would move every real token's position. The loop puts its prompt first instead, the bucket's padding after it
    (:func:`hf_tpu.transformers._graphs._aligned_prefill`). (Encoder-decoder models are not affected: their decoder
    prompt is never padded.)"""
    if model.config.is_encoder_decoder:
        return False
    try:
        takes_positions = "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if takes_positions:
        return False
    text = model.config.get_text_config(decoder=True)
    sizes = (getattr(text, f, None) for f in ("max_position_embeddings", "max_target_positions"))
    return any(isinstance(n, int) and n > 0 for n in sizes)  # XLNet's -1: no position table


def own_generate(model) -> str | None:
    """Why hf_tpu's loop does not serve ``model.generate``, where its class defines a ``generate`` of its own that
    never hands over to ``GenerationMixin.generate`` (MusicGen's decoders: their own loop over codebooks, calling the
    sampler directly): hf_tpu plugs into ``GenerationMixin.generate`` only, so the class's code runs eagerly on the
    TPU, with its inputs on the model's device as on any accelerator. None for a class that inherits
    ``GenerationMixin.generate``, or whose class code calls ``super().generate(...)`` somewhere (Whisper's, from a
    helper of its own generate): read from the class's source, as nothing else tells."""
    from transformers.generation.utils import GenerationMixin

    cls = type(model)
    if not isinstance(model, GenerationMixin) or cls.generate is GenerationMixin.generate:
        return None
    owner = next(c for c in cls.__mro__ if "generate" in vars(c))
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError):
        return None  # no source to read: not claimed
    if "super().generate(" in source or "GenerationMixin.generate(" in source:
        return None
    return (
        f"{cls.__name__}: its class has a generate of its own ({owner.__name__}.generate, not "
        "GenerationMixin.generate where hf_tpu's loop plugs in): upstream's code runs eagerly on the TPU, its inputs "
        "on the model's device"
    )
