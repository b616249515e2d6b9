"""A call not made yet: the plan of a call with the model's own ``generation_config`` (updated by a call's keyword
arguments), asked without a call.

:func:`hf_tpu.warmup` compiles the graph variant it leads to (:func:`own_variant`, :func:`default_variant`), with
dummy device sampling state (:func:`warm_sampling`) and the eager ops of the read-back (:func:`warm_read_back`);
:func:`hf_tpu.transformers.explain` says where its logits processors and sampler would run (:func:`host_sampling`).
Each asks the one decision a call asks (:func:`~.skeleton.sampling_plan`), on the processors upstream's ``generate``
would build.
"""

from __future__ import annotations

from hf_tpu.errors import InvalidArgumentError
from hf_tpu.transformers._graph_key import NO_VARIANT, Variant
from hf_tpu.transformers._loops import readback
from hf_tpu.transformers._loops.skeleton import fill_id, output_vocab, sampling_plan
from hf_tpu.transformers._settings import model_state

__all__ = ["default_variant"]


def _default_processors(model, input_ids, **generate_kwargs):
    """The generation config of a call with the model's own ``generation_config`` (updated by ``generate_kwargs``, as
    a call's keyword arguments update it) and the processors upstream's ``generate`` would build for it."""
    from transformers.generation.logits_process import LogitsProcessorList

    config, _ = model._prepare_generation_config(None, **generate_kwargs)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device="cpu")
    # As upstream's generate does before building the processors: min_new_tokens also sets min_length (prompt +
    # min_new_tokens), which adds a MinLengthLogitsProcessor, so the call runs "+min_length+min_new_tokens".
    model._prepare_generated_length(
        config, has_default_max_length=True, has_default_min_length=True, model_input_name="input_ids",
        input_ids_length=input_ids.shape[1], inputs_tensor=input_ids,
    )  # fmt: skip
    processors = model._get_logits_processor(
        generation_config=config, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
        logits_processor=LogitsProcessorList(), device="cpu", model_kwargs={},
    )  # fmt: skip
    return config, processors


def _default_plan(model, input_ids, **generate_kwargs):
    """The device plan (or the host-path reason) of the processors of a call with the model's own
    ``generation_config`` updated by ``generate_kwargs`` (:func:`_default_processors`)."""
    from hf_tpu.transformers.sampling import device_plan

    config, processors = _default_processors(model, input_ids, **generate_kwargs)
    return device_plan(processors, input_ids, vocab=output_vocab(model), do_sample=bool(config.do_sample))


def host_sampling(model, **generate_kwargs) -> str | None:
    """Why a call with ``generate_kwargs`` keeps its logits processors and sampling on the host (one logits row
    back per step), None when they run in the graph: what :class:`~.skeleton.LoopCall` finds
    (:func:`~.skeleton.sampling_plan`), without a call."""
    import torch

    config, _ = model._prepare_generation_config(None, **generate_kwargs)
    ids = generate_kwargs.pop("input_ids", None)
    ids = torch.zeros(1, 1, dtype=torch.long) if ids is None else ids.to("cpu")
    fields = {k: v for k, v in generate_kwargs.items() if not hasattr(v, "device")}
    _, processors = _default_processors(model, ids, **fields)
    plan = sampling_plan(model, config, processors, ids)
    return plan if isinstance(plan, str) else None


def own_variant(model) -> Variant:
    """The graph variant the model's own ``generation_config`` leads to (its sampling program; none for plain greedy
    search or the host path); :func:`hf_tpu.warmup` compiles that one."""
    import torch

    plan = _default_plan(model, torch.zeros(1, 1, dtype=torch.long))
    return NO_VARIANT if isinstance(plan, str) else plan.variant


def default_variant(model) -> str:
    """The graph variant the model's own ``generation_config`` leads to, as the text its graphs' kinds end with
    (``"+temperature+top_k+top_p+sample"`` for Qwen3's, ``"+repetition_penalty"`` for greedy search with a
    repetition penalty, ``""`` for plain greedy search or the host path); :func:`hf_tpu.warmup` compiles that one.

    Example:
        >>> default_variant(model)                                      # doctest: +SKIP
        '+temperature+top_k+top_p+sample'
    """
    return str(own_variant(model))


def warm_sampling(model, ids, variant: Variant, width: int, offset: int):
    """Dummy device sampling state for warming ``variant`` (the model's default one) on prompt ``ids``."""
    if not variant:
        return None
    plan = _default_plan(model, ids)
    if isinstance(plan, str) or plan.variant != variant:
        found = plan if isinstance(plan, str) else plan.variant
        raise InvalidArgumentError(
            f"warm-up can compile the variant of the model's own generation_config only; asked for {str(variant)!r}, "
            f"the generation_config leads to {str(found)!r}"
        )
    return plan.to_device(model.device, width, offset)


def warm_read_back(model, batch: int) -> None:
    """Run the eager ops of :class:`~.readback.DeviceRows` for ``batch`` rows and the model's own
    ``generation_config``, so that a strict warm-up (``strict="eager"``) covers them."""
    import torch

    every = model_state(model).settings.read_back_every
    if every <= 1:
        return
    config = model.generation_config
    eos = config.eos_token_id
    eos = None if eos is None else torch.tensor([eos] if isinstance(eos, int) else list(eos), dtype=torch.long)
    pad = config.pad_token_id
    if pad is None and eos is not None:
        pad = int(eos[0])  # (upstream's generate pads with the first eos id when no pad id is set)
    rows = readback.DeviceRows(model.device, batch, every, pad, fill_id(model, pad, eos), eos)
    with torch.no_grad():
        tokens = torch.zeros(batch, dtype=torch.long, device=model.device)
        rows.add(tokens)
        rows.add(tokens)
        rows.read()
        rows.sync(torch.zeros(batch, dtype=torch.long))
