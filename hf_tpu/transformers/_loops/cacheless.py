"""The loop without a cache: each step runs the model over the whole sequence, padded to a static bucket.

A call with ``use_cache=False``, or a model whose forward writes nothing into the cache it is given (OpenAI GPT:
it recomputes the whole sequence each step), has no cache for hf_tpu's static, bucketed one to replace. Upstream's
loop then grows the sequence by one token per forward: a new shape, hence new compiles, at every step on a TPU.
This loop keeps one shape per call instead: the token ids live on the device in a buffer as long as the cache
bucket of the call's shape plan (:func:`hf_tpu.transformers.shapes.plan_shapes`), the prompt first and the
bucket's padding after it. Each step sends one ``(batch, 2)`` tensor (the new tokens and their slot); the graph
writes the tokens into the buffer, runs the model over all of it and reads the logits at that slot, and the next
tokens come back (the device sampling plan of :mod:`hf_tpu.transformers.sampling` runs in the graph as in the
cached loop's).

The prompt goes first because a causal model's outputs at a position never depend on later positions, whatever
they hold: the padding after the sequence changes nothing before it, for attention, ALiBi, absolute positions or a
recurrent state alike, and each token keeps the position upstream gives it. The mask and the positions of the
whole bucket are computed once per call (the prompt's as upstream's ``generate`` prepares them, then one more per
slot), sent with the first step. Two graph kinds, compiled per (batch, bucket): ``cacheless_prefill`` (the
prompt's last slot) and ``cacheless_decode`` (writes the new tokens first); their bodies live in the graph table
(:mod:`hf_tpu.transformers._graphs`) and run through its ``run_graph`` (strict mode, the persistent compile cache) like
the cached loop's. Token types (GPT-2's ``token_type_ids``) fill a buffer of their own: the prompt's, then its last
one for every slot after it, as upstream's loop extends them by the last one at each step.

A decoder-only model whose cached form hf_tpu cannot run (its own cache type, a cache that cannot be sized, a
forward that does not trace as one graph with a cache) runs this loop too, when two checks pass
(:func:`cacheless_problem`, once per model): its outputs on a sequence do not change with the tokens after it (one
eager forward on two paddings), and its ``prepare_inputs_for_generation`` makes no inputs of its own. A model that
fails them, or whose graphs here do not trace either, runs upstream's loop. Which loop a call takes is decided in
:mod:`hf_tpu.transformers.route`.
"""

from __future__ import annotations

import inspect

from hf_tpu.transformers._graph_key import NO_VARIANT, GraphKind, Variant
from hf_tpu.transformers._images import mrope_rows
from hf_tpu.transformers._loops.defaults import warm_sampling
from hf_tpu.transformers._loops.skeleton import LoopCall, LoopSpec, Steps, fill_id, loop, register_loop
from hf_tpu.transformers._notes import warn_once
from hf_tpu.transformers._settings import CACHELESS

__all__: list[str] = []


# What generate says (once per reason) when the cached loop cannot serve a model and this one does instead.
NO_CACHE_NOTE = (
    "generate runs hf_tpu's loop without a cache instead (each step recomputes the whole sequence in one compiled "
    "graph: no compile per step, but each step's work grows with the bucket)"
)
_INPUTS_AS_GIVEN: dict[type, bool] = {}


def cacheless_problem(model) -> str | None:
    """Why this loop cannot serve ``model`` (None when it can): the padding after a sequence changes its outputs
    (:func:`_not_causal`: one eager forward; :mod:`hf_tpu.transformers.route` asks once per model and keeps the
    answer with the model's route), or it prepares inputs of its own for each forward, which this loop would not
    pass."""
    if mrope_rows(model) > 1:
        return (
            f"{type(model).__name__} numbers its positions in three rows (multimodal rotary positions), which hf_tpu's "
            "loop without a cache does not carry"
        )
    failure = _not_causal(model)
    if failure is not None:
        return failure
    if not _inputs_as_given(model):
        return (
            f"{type(model).__name__}.prepare_inputs_for_generation makes inputs of its own for each forward, which "
            "hf_tpu's loop without a cache does not make"
        )
    return None


def _not_causal(model) -> str | None:
    """Why the padding after a sequence would change the model's outputs on it (None when it does not): one eager
    forward on the device of a 3-token prompt followed by 5 tokens, one of the prompt followed by 9 other tokens;
    the logits at the prompt's last position must agree to rounding (a causal model's do; a bidirectional one, or
    one whose outputs depend on the sequence length, ProphetNet's, do not)."""
    import torch

    vocab = int(getattr(model.config.get_text_config(decoder=True), "vocab_size", 0) or 0)
    if vocab < 8:
        return None  # pragma: no cover - no room for distinct tokens
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, vocab, (1, 3), generator=g)
    logits = []
    try:
        with torch.no_grad():
            for tail in (5, 9):
                ids = torch.cat([prompt, torch.randint(1, vocab, (1, tail), generator=g)], dim=1)
                kwargs = dict(cacheless_extra(model), attention_mask=torch.ones_like(ids))
                if _takes(model, "position_ids"):
                    kwargs["position_ids"] = torch.arange(ids.shape[1])[None]
                kwargs = {k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
                out = model(input_ids=ids.to(model.device), return_dict=True, **kwargs)
                logits.append(out.logits[:, 2].float().to("cpu"))
    except Exception as exc:  # noqa: BLE001 - the forward rejects a plain call: not known to be safe
        return f"{type(model).__name__}'s forward without a cache failed ({type(exc).__name__}: {exc})"
    scale = 1.0 + float(logits[0].abs().max())
    if float((logits[0] - logits[1]).abs().max()) > 64 * torch.finfo(model.dtype).eps * scale:
        return (
            f"{type(model).__name__}'s outputs on a sequence change with the tokens after it (it is not causal, or "
            "depends on the sequence's length), so a bucket's padding cannot follow the sequence"
        )
    return None


def cache_changes_outputs(model) -> str | None:
    """Why a forward with a cache computes what this loop, without one, would not (None when both agree): upstream's
    own loop (the original ``GenerationMixin.generate``, greedy, eager on the device, with whatever cache the model
    keeps: upstream's ``Cache`` classes, RWKV's ``state``, ...) generates 2 tokens after a 7-token prompt, and this
    loop's forward without a cache runs over the prompt and over the prompt and the first token; the logits of each
    step must agree to float32 rounding, both computed at float32 matmul precision ``'highest'`` whatever the setting
    (at a TPU's default, one bfloat16 pass, a full forward and a one-token step differ by about 1e-3 of the logits'
    scale: a tiny Llama's did, and the check is about what the model computes, not the device's rounding). A model
    whose forward reads its cache past the layers' ``update`` (Dory's ``recurrent_kv_cache_mode="last_loop"``: earlier
    loops read the last loop's keys through ``shared_kv_states``) computes other outputs with a cache, which is what
    upstream's loop runs with. Asking upstream's loop, not a forward handed a ``DynamicCache``, keeps a model whose
    cache is not upstream's (it takes it under another name and would ignore one) from reading as one whose outputs
    change."""
    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    from hf_tpu.transformers._upstream import inputs_on_model_device, running, upstream_generate

    vocab = int(getattr(model.config.get_text_config(decoder=True), "vocab_size", 0) or 0)
    if vocab < 8:
        return None  # pragma: no cover - no room for distinct tokens
    prompt = torch.randint(1, vocab, (1, 7), generator=torch.Generator().manual_seed(1))
    positions = _takes(model, "position_ids")

    def forward(ids):
        kwargs = {**cacheless_extra(model), "attention_mask": torch.ones_like(ids)}
        if positions:
            kwargs["position_ids"] = torch.arange(ids.shape[1])[None]
        kwargs = {k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        out = model(input_ids=ids.to(model.device), return_dict=True, **kwargs)
        return out.logits[:, -1].float().to("cpu")

    verbosity, precision = hf_logging.get_verbosity(), torch.get_float32_matmul_precision()
    try:
        hf_logging.set_verbosity_error()  # (upstream's notes on the generation config: this check's own business)
        torch.set_float32_matmul_precision("highest")
        with torch.no_grad(), warnings.catch_warnings(), inputs_on_model_device(model), running():
            warnings.simplefilter("ignore")
            out = upstream_generate()(
                model, prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2, min_new_tokens=2,
                do_sample=False, num_beams=1, use_cache=True, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            with_cache = [step.float().to("cpu") for step in out.logits]
            sequence = out.sequences.to("cpu")
            without = [forward(sequence[:, : prompt.shape[1] + i]) for i in range(len(with_cache))]
    except Exception:  # noqa: BLE001 - upstream's loop or a plain call fails: the other checks say so
        return None
    finally:
        torch.set_float32_matmul_precision(precision)
        hf_logging.set_verbosity(verbosity)
    for a, b in zip(without, with_cache, strict=True):
        if float((a - b).abs().max()) > 64 * torch.finfo(model.dtype).eps * (1.0 + float(a.abs().max())):
            return (
                f"{type(model).__name__}'s outputs with a cache differ from its outputs without one (its forward "
                "reads its cache past the layers' update), and upstream's loop runs it with a cache"
            )
    return None


def _inputs_as_given(model) -> bool:
    """Whether the model's ``prepare_inputs_for_generation`` hands its forward, without a cache, the ids, mask and
    positions it is given and nothing else (upstream's own does; OpenAI GPT's too; XLM's appends a mask token),
    tried once per class on a small host input."""
    import torch
    from transformers.generation.utils import GenerationMixin

    cls = type(model)
    if cls.prepare_inputs_for_generation is GenerationMixin.prepare_inputs_for_generation:
        return True
    if cls not in _INPUTS_AS_GIVEN:
        given = {
            "input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
            "position_ids": torch.arange(3)[None],
        }  # fmt: skip
        try:
            got = model.prepare_inputs_for_generation(**given, use_cache=False, is_first_iteration=True)
            tensors = {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}
            # (compared on the host: upstream's own method, which an override may call, moves them onto the
            # model's device, a tpu one here)
            same = set(tensors) <= set(given) and all(torch.equal(v.cpu(), given[k]) for k, v in tensors.items())
            _INPUTS_AS_GIVEN[cls] = same and "input_ids" in tensors
        except Exception:  # noqa: BLE001 - any failure: not known to be safe
            _INPUTS_AS_GIVEN[cls] = False
    return _INPUTS_AS_GIVEN[cls]


def _takes(model, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - an odd forward
        return False


def _position_limit(model) -> int | None:
    """The size of the position table of a model that numbers its tokens itself (no ``position_ids``): the buffer
    must not pass it (its padding slots take positions too)."""
    if _takes(model, "position_ids"):
        return None
    text = model.config.get_text_config(decoder=True)
    sizes = [getattr(text, f, None) for f in ("max_position_embeddings", "max_target_positions", "n_positions")]
    sizes = [n for n in sizes if isinstance(n, int) and n > 0]
    return min(sizes) if sizes else None


def buffer_length(model, cache_bucket: int, need: int) -> int:
    """The buffer's length for a plan's ``cache_bucket``: the bucket, within the model's position table when it
    numbers tokens itself (never below ``need``, the slots the call fills)."""
    limit = _position_limit(model)
    return cache_bucket if limit is None else max(min(cache_bucket, limit), need)


def length_for(model, state, batch: int, prompt_len: int, new_tokens: int, variant: Variant) -> int:
    """The buffer's length for a call: the shortest one compiled that holds the call (what warm-up compiled), else
    the cache bucket of the call's shape plan (which also refuses a call past the model's ladder)."""
    from hf_tpu.transformers._loops.skeleton import plan_shapes

    plan = plan_shapes(model, batch, prompt_len, new_tokens, variant=variant)
    need = prompt_len + max(new_tokens, 1) - 1
    kind = GraphKind("cacheless_prefill", variant)
    compiled = sorted(
        k.dim("cache bucket")
        for k in state.compiled
        if k.kind == kind and k.batch == batch and k.dim("cache bucket") >= need
    )
    return compiled[0] if compiled else buffer_length(model, plan.cache_bucket, need)


def cacheless_extra(model) -> dict:
    """The graphs' constant model arguments (``use_cache=False`` where the forward takes it)."""
    return {"use_cache": False} if _takes(model, "use_cache") else {}


def cacheless_layout(model, input_ids, model_kwargs: dict, length: int, new_tokens: int, pad_id: int):
    """The buffer's host tensors: ids (the prompt first, ``pad_id``, an id the model embeds, after), the mask (the
    prompt's, ones after) and the positions (None for a model without ``position_ids``: it numbers the buffer itself,
    0 to ``length - 1``)."""
    import torch
    import torch.nn.functional as F

    batch, prompt_len = input_ids.shape
    ids = F.pad(input_ids, (0, length - prompt_len), value=pad_id)
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones(batch, prompt_len, dtype=torch.long) if mask is None else mask.to("cpu").long()
    full_mask = F.pad(mask, (0, length - prompt_len), value=1)
    if not _takes(model, "position_ids"):
        return ids, full_mask, None
    positions = model_kwargs.get("position_ids")
    if positions is None:  # as upstream's generate prepares them
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    positions = positions.to("cpu").long().expand(batch, prompt_len)
    last = positions[:, -1:]
    after = last + torch.arange(1, length - prompt_len + 1).clamp(max=max(new_tokens - 1, 0))
    return ids, full_mask, torch.cat([positions, after], dim=1)  # (slots no token reaches keep the last position)


def cacheless_steps(call: LoopCall, model, model_kwargs: dict) -> Steps:
    """The part of a call without a cache (:func:`cacheless_loop`, see the module docstring): the buffer's layout, the
    prefill graph, then one decode graph per new token; no cache to return."""
    import torch

    from hf_tpu.transformers._graphs import run_graph

    state, device, variant, batch, prompt_len = call.state, model.device, call.variant, call.batch, call.prompt_len
    length = length_for(model, state, batch, prompt_len, call.new_tokens, variant)
    ids, mask, positions = cacheless_layout(model, call.input_ids, model_kwargs, length, call.new_tokens, call.fill_id)
    ids_dev, mask_dev = ids.to(device), mask.to(device)
    positions_dev = None if positions is None else positions.to(device)
    extra = {**cacheless_extra(model), **call.output_flags}
    types = model_kwargs.get("token_type_ids")
    if types is not None:  # the prompt's, then its last one for every new token, as upstream's loop extends them
        types = types.to("cpu").long()
        extra["token_type_ids"] = torch.cat([types, types[:, -1:].expand(batch, length - prompt_len)], 1).to(device)
        variant = variant.with_features("token_type_ids")
    args = (mask_dev, positions_dev, extra, call.sampling(device, length + 1, 0))
    prefill_key = (GraphKind("cacheless_prefill", variant), batch, length)
    decode_key = (GraphKind("cacheless_decode", variant), batch, length)
    slot = torch.tensor([prompt_len - 1]).to(device)
    first = run_graph(model, state, prefill_key, ids_dev, slot, *args)
    first = call.take(first, slice(0, prompt_len), slice(0, prompt_len))  # (upstream: the whole sequence each step)
    next_slot = prompt_len

    def step(next_tokens):
        nonlocal next_slot
        packed = decode_input(next_tokens, next_slot, device)
        next_slot += 1
        result = run_graph(model, state, decode_key, ids_dev, packed, *args)
        return call.take(result, slice(0, next_slot), slice(0, next_slot))

    return Steps(first, length - prompt_len, step)


# ``custom_generate`` callable of a call without a cache (see the module docstring).
cacheless_loop = loop(cacheless_steps)


def run_cacheless(model, *args, hf_tpu_plan: dict, **kwargs):
    """The route ``"cacheless"``'s loop: :func:`cacheless_loop`, then, where the cached loop cannot serve the model,
    its reason said once (after the graphs ran: a graph that fails its first trace moves the model on instead)."""
    result = cacheless_loop(model, *args, hf_tpu_plan=hf_tpu_plan, **kwargs)
    route = hf_tpu_plan["route"]
    if route.warn:
        warn_once(f"no cache:{route.reason}", f"hf_tpu: {route.reason}; {NO_CACHE_NOTE}.")
    return result


def decode_input(next_tokens, slot: int, device):
    """A decode step's ``(batch, 2)`` input on the device: the next tokens (on the device, where the loop keeps them
    between read-backs, or on the host) and the slot they go to."""
    import torch

    tokens = next_tokens.to(device)
    return torch.stack([tokens, torch.full_like(tokens, slot)], dim=1)



def warm(model, plan, variant: Variant = NO_VARIANT) -> list[tuple]:
    """Compile (or find compiled) the two graphs a call with ``plan`` runs, on dummy inputs; returns their keys."""
    import torch

    from hf_tpu.transformers._graphs import run_graph
    from hf_tpu.transformers._settings import model_state

    state = model_state(model)
    device = model.device
    batch = plan.batch
    length = buffer_length(model, plan.cache_bucket, plan.prompt_bucket)
    ids = torch.zeros(batch, plan.prompt_len, dtype=torch.long)
    with torch.no_grad():
        buffer, mask, positions = cacheless_layout(model, ids, {}, length, length - plan.prompt_len + 1, fill_id(model, None))
        buffer, mask = buffer.to(device), mask.to(device)
        positions = None if positions is None else positions.to(device)
        extra = cacheless_extra(model)
        sampling = warm_sampling(model, ids, variant, length + 1, 0)
        prefill_key = (GraphKind("cacheless_prefill", variant), batch, length)
        decode_key = (GraphKind("cacheless_decode", variant), batch, length)
        slot = torch.tensor([plan.prompt_len - 1]).to(device)
        run_graph(model, state, prefill_key, buffer, slot, mask, positions, extra, sampling)
        step = decode_input(torch.zeros(batch, dtype=torch.long), min(plan.prompt_len, length - 1), device)
        run_graph(model, state, decode_key, buffer, step, mask, positions, extra, sampling)
    return [prefill_key, decode_key]


register_loop(LoopSpec(CACHELESS, run_cacheless, warm))
