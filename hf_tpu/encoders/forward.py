"""The bucketed encoder forward: pad to a bucket on the host, run one compiled graph per bucket, slice back.

:func:`call` is what a patched encoder ``forward`` runs (:mod:`hf_tpu.encoders._integration`). On a model that is
not on a ``tpu`` device it is upstream's call, unchanged. On the TPU, :func:`hf_tpu.encoders.route.decide` picks the
path; the bucketed one (:func:`run`):

1. pads on the host: ``input_ids`` (with the config's ``pad_token_id``), ``attention_mask`` (0 on padded
   positions; a padded row sees its first slot, so no softmax row is empty) and ``token_type_ids`` (0) to
   ``(batch bucket, length bucket)``, packed into one ``(k, B, L)`` tensor: one host->device copy. Inputs already on
   the device are read back first (one small copy each); inputs may stay on the CPU;
2. runs upstream's own forward on it under ``torch.compile(backend="tpu", fullgraph=True, dynamic=False)``: one
   graph per (batch bucket, length bucket, outputs asked, grad mode), compiled on its first call;
3. slices every output back to the call's rows and tokens (views, no device op): padded keys are masked out and
   every position attends only within its own row, so the real positions equal upstream's unpadded forward.

Outputs come back on the device, as upstream's do.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
from typing import Any

from hf_tpu.encoders import route as _route
from hf_tpu.encoders._state import EncoderRecompileError, state
from hf_tpu.errors import HfTpuError
from hf_tpu._shared.notes import warn_once

logger = logging.getLogger("hf_tpu.encoders")

__all__ = ["DEVICE_TYPES", "NotOneGraph", "Unpaddable", "bind", "call", "problem", "run"]

# Device types the bucketed path takes over (tests may widen it to compare on CPU).
DEVICE_TYPES: set[str] = {"tpu"}

# True while hf_tpu handles an encoder call: the forwards it reaches inside (BertModel inside
# BertForSequenceClassification) are then upstream's.
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_tpu_encoder_active", default=False)

# Output fields by how their padding is undone: rows only, or rows and tokens ("logits": by its rank).
_ROWS = frozenset({"pooler_output"})
_ROWS_AND_TOKENS = frozenset({"last_hidden_state", "hidden_states", "start_logits", "end_logits"})
# Heads whose ``logits`` are per token with no class axis, (batch, length): ELECTRA's replaced-token discriminator.
_TOKEN_LOGITS_2D = frozenset({"ElectraForPreTraining"})


class Unpaddable(HfTpuError, RuntimeError):
    """An output field the bucketed path cannot slice back (its meaning of the padded axes is unknown)."""


class NotOneGraph(HfTpuError, RuntimeError):
    """The first trace of a bucket's graph broke (a graph break under fullgraph, a data-dependent shape)."""


def _device(model):
    try:
        return model.device
    except (AttributeError, StopIteration):
        return None


@functools.cache
def _signature(upstream) -> inspect.Signature:
    return inspect.signature(upstream)


def bind(upstream, model, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name (``**kwargs`` of the forward flattened in)."""
    signature = _signature(upstream)
    arguments = dict(signature.bind(model, *args, **kwargs).arguments)
    arguments.pop(next(iter(signature.parameters)), None)  # self
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
    return arguments


def call(model, upstream, args: tuple, kwargs: dict):
    """``upstream(model, *args, **kwargs)``, bucketed and compiled where the model sits on the TPU and the call
    allows it (:func:`hf_tpu.encoders.route.decide`), else upstream's eager call with the reason said once."""
    device = _device(model)
    if _ACTIVE.get() or device is None or device.type not in DEVICE_TYPES:
        return upstream(model, *args, **kwargs)
    token = _ACTIVE.set(True)
    try:
        try:
            arguments = bind(upstream, model, args, kwargs)
        except TypeError:
            return upstream(model, *args, **kwargs)  # upstream names the wrong argument itself
        found = _route.decide(model, upstream, arguments)
        if not found.bucketed:
            if found.quiet:
                logger.debug("hf_tpu: upstream's forward: %s", found.reason)
            else:
                _note(found.reason)
            return _eager(model, upstream, args, kwargs, device)
        try:
            return run(model, upstream, found)
        except (Unpaddable, NotOneGraph) as exc:
            state(model).problem = problem(model, exc)
        _note(state(model).problem)
        return _eager(model, upstream, args, kwargs, device)
    finally:
        _ACTIVE.reset(token)


def problem(model, exc: Unpaddable | NotOneGraph) -> str:
    """Why ``model`` cannot take the bucketed path at all, from what its first graph ran into."""
    if isinstance(exc, Unpaddable):
        return f"{type(model).__name__}: its output {exc} has padded axes the bucketed path cannot slice back"
    return (
        f"{type(model).__name__}'s forward cannot be compiled as one static-shape graph ({exc}): "
        "upstream's eager forward runs it"
    )


def _eager(model, upstream, args: tuple, kwargs: dict, device):
    """Upstream's call, with tensor arguments left on the CPU moved to the model's device first (the bucketed path
    takes them there; the eager one should not refuse them)."""
    import torch

    def move(value):
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            return value.to(device)
        return value

    return upstream(model, *(move(a) for a in args), **{k: move(v) for k, v in kwargs.items()})


def _note(reason: str) -> None:
    warn_once(f"encoder:{reason}", f"hf_tpu: the encoder forward runs upstream's eager path: {reason}")


def _graph(model, upstream, packed, names: tuple[str, ...], hidden_states: bool):
    """The compiled unit: upstream's forward on the padded inputs (``packed[i]`` is input ``names[i]``)."""
    inputs = {name: packed[i] for i, name in enumerate(names)}
    return upstream(model, **inputs, output_hidden_states=hidden_states, return_dict=True)


@functools.cache
def _compiled(backend: str):
    import torch

    from hf_tpu._capture_registry import without_registry_guards

    return torch.compile(_graph, backend=backend, fullgraph=True, dynamic=False,
                         options={"guard_filter_fn": without_registry_guards})  # fmt: skip


def _pack(model, found: _route.EncoderRoute, names: tuple[str, ...]):
    """The padded inputs as one ``(len(names), B, L)`` int64 host tensor."""
    import torch

    rows, length = found.rows, found.length
    pad = getattr(model.config, "pad_token_id", None)
    packed = torch.zeros(len(names), found.batch_bucket, found.length_bucket, dtype=torch.long)
    for i, name in enumerate(names):
        value = found.inputs.get(name)
        if name == "input_ids" and pad:
            packed[i].fill_(int(pad))
        if value is not None:
            packed[i, :rows, :length] = value.to("cpu", torch.long)
        elif name == "attention_mask":
            packed[i, :rows, :length] = 1
        if name == "attention_mask":
            packed[i, rows:, 0] = 1  # padded rows: one visible slot, so their softmax rows are not empty
    return packed


def run(model, upstream, found: _route.EncoderRoute):
    """The bucketed forward of one call whose route is ``found`` (bucketed)."""
    import torch

    names = _route.input_names(upstream)
    grad = torch.is_grad_enabled()
    key = (found.batch_bucket, found.length_bucket, names, found.hidden_states, grad)
    model_state = state(model)
    first = key not in model_state.compiled
    if first and model_state.warmed and model_state.is_strict():
        raise EncoderRecompileError(
            f"{type(model).__name__} needs the encoder graph for batch {found.batch_bucket} x length "
            f"{found.length_bucket}{' with hidden states' if found.hidden_states else ''}, which warm-up did not "
            f"compile (strict mode; {len(model_state.compiled)} graph(s) compiled). Warm up for it "
            f"(hf_tpu.encoders.warmup(model, max_length={found.length_bucket}, batch_sizes=[{found.batch_bucket}])), "
            "or allow compiles: hf_tpu.encoders.configure(model, strict=False) / unset HF_TPU_STRICT_COMPILE."
        )
    device = _device(model)
    backend = "tpu" if device.type == "tpu" else "aot_eager"
    limits = {"recompile_limit": max(torch._dynamo.config.recompile_limit, 1024)}
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        limits["accumulated_recompile_limit"] = max(torch._dynamo.config.accumulated_recompile_limit, 4096)
    # Inside inference_mode, make the inputs and run the graph with it off (and no grad): the inputs are then plain
    # tensors as in any no-grad call (dynamo guards on their dispatch keys), so one graph serves both.
    mode = torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()
    if first and found.hidden_states:
        _install_capturing_hooks(model)
    with torch._dynamo.config.patch(**limits), mode, torch.set_grad_enabled(grad):
        packed = _pack(model, found, names).to(device)  # one host->device copy
        fn = _compiled(backend)
        if first:
            out = _first(fn, model, upstream, packed, names, found.hidden_states)
        else:
            out = fn(model, upstream, packed, names, found.hidden_states)
    if first:
        model_state.compiled.add(key)
        model_state.compile_log.append(key)
        logger.info("hf_tpu: compiled the encoder graph for batch %d x length %d", key[0], key[1])
    out = _unpad(out, found, type(model).__name__ in _TOKEN_LOGITS_2D)
    return out if found.return_dict else out.to_tuple()


def _install_capturing_hooks(model) -> None:
    """transformers' output-capturing hooks (what collects hidden states), installed before a trace: installing them
    takes a lock, which dynamo cannot trace."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # a transformers without them collects hidden states in the forward itself
        return
    maybe_install_capturing_hooks(model)


def _first(fn, model, upstream, packed, names, hidden_states):
    """The first run of a bucket's graph (its trace); a forward that is not one graph raises :class:`NotOneGraph`."""
    import torch
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        return fn(model, upstream, packed, names, hidden_states)
    except (torch._dynamo.exc.Unsupported, GuardOnDataDependentSymNode) as exc:
        raise NotOneGraph((str(exc).strip().splitlines() or [type(exc).__name__])[0]) from exc


def _unpad(out, found: _route.EncoderRoute, token_logits: bool = False):
    """Every output field sliced back to the call's rows (and tokens, for per-token fields; ``token_logits``:
    ``logits`` are per token even with two axes)."""
    rows, length = found.rows, found.length
    if rows == found.batch_bucket and length == found.length_bucket:
        for name, value in out.items():
            _rule(name, value, token_logits)  # the check of slicing: an unknown field is unknown at any size
        return out
    for name, value in list(out.items()):
        tokens = _rule(name, value, token_logits)
        if isinstance(value, tuple):
            out[name] = tuple(v[:rows, :length] if tokens else v[:rows] for v in value)
        else:
            out[name] = value[:rows, :length] if tokens else value[:rows]
    return out


def _rule(name: str, value, token_logits: bool = False) -> bool:
    """Whether field ``name`` has a token axis to slice (else rows only); :class:`Unpaddable` when unknown."""
    if name in _ROWS_AND_TOKENS:
        return True
    if name in _ROWS:
        return False
    if name == "logits":
        # (batch, length, classes/vocab) per token; (batch, classes) per sequence
        return token_logits or value.dim() >= 3
    raise Unpaddable(f"{name!r}")
