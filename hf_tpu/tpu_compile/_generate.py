"""The lowering process's entry for ``generate``: hf_tpu's own warm-up, run on a model whose weights are deferred
``tpu`` tensors (``to_empty``: no memory), so that exactly the prefill and decode graphs ``generate`` would compile
on a chip go through torch_tpu's lowering. Runs inside :mod:`hf_tpu.tpu_compile._child` only.
"""

from __future__ import annotations

from typing import Any

from hf_tpu.errors import InvalidArgumentError

__all__ = ["build_deferred", "label", "lower_generate", "weight_bytes"]


def label(key: tuple, decodes: int = 1) -> str:
    """A program's name from its graph key (its kind a :class:`~hf_tpu.transformers._graph_key.GraphKind`):
    ``prefill-2048``, ``decode`` (``decode-2304`` when there are several)."""
    from hf_tpu.transformers._graph_key import GraphKey

    key = GraphKey.of(key)
    base = key.kind.base
    if base == "prefill":
        return f"prefill-{key.dim('prompt bucket')}"
    if base == "decode":
        return "decode" if decodes == 1 else f"decode-{key.dim('cache bucket')}"
    return "-".join(str(k) for k in key)


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights once)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        inner = getattr(tensor, "tensor_data_names", None)  # torchao's tensor subclasses: their inner tensors
        inner = inner() if callable(inner) else inner
        parts = [getattr(tensor, n) for n in inner] if inner else [tensor]
        for part in parts:
            if id(part) in seen or not hasattr(part, "numel"):
                continue
            seen.add(id(part))
            total += part.numel() * part.element_size()
    return total


def _gathered_embedding_bytes(model) -> int:
    """Bytes of the input embedding table when it is not also the output head: a decode step reads one row of it,
    not the table, so it is not part of the step's floor."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    weight = getattr(embed, "weight", None)
    if weight is None or (head is not None and getattr(head, "weight", None) is weight):
        return 0
    return weight.numel() * weight.element_size()


def _experts_facts(model) -> dict:
    """A MoE's routed experts: ``experts_bytes`` (every experts module's stacked (E, ., .) weights), ``num_experts``
    and ``top_k``; empty for a model without them. A decode step reads only the routed experts' share of those
    bytes (the plan's floor)."""
    text = model.config.get_text_config(decoder=True)
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    if not isinstance(experts, int) or not isinstance(top_k, int) or experts <= top_k:
        return {}
    total = 0
    for module in model.modules():
        for name in ("gate_up_proj", "down_proj", "up_proj", "gate_proj"):
            weight = getattr(module, name, None)
            if getattr(weight, "ndim", 0) == 3 and weight.shape[0] == experts:
                total += weight.numel() * weight.element_size()
    return {"experts_bytes": total, "num_experts": experts, "top_k": top_k} if total else {}


def _kv_estimate(config, batch: int, cache_len: int, dtype) -> int:
    """2 x layers x KV heads x head size x cache length x batch x element size: a plain KV cache's bytes, for the
    fit check before anything is lowered (0 where the config does not say it plainly: per-layer sizes, no heads)."""
    import torch

    try:
        text = config.get_text_config(decoder=True)
        heads = getattr(text, "num_attention_heads", 0) or 0
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
        layers = getattr(text, "num_hidden_layers", 0) or 0
    except Exception:  # noqa: BLE001 - a config whose sizes are per layer (dots3): the cache is measured later
        return 0
    if not all(isinstance(v, int) for v in (kv_heads, head_dim, layers)):
        return 0
    return 2 * layers * kv_heads * head_dim * cache_len * batch * torch.empty((), dtype=dtype).element_size()


def build_deferred(model: str, dtype: str | None = None, generation: dict | None = None, **from_config: Any):
    """The model of ``model`` (a directory or a config.json) with its weights as deferred tpu tensors."""
    import os

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.path.dirname(model) if model.endswith(".json") else model
    config = AutoConfig.from_pretrained(path)
    torch_dtype = getattr(torch, dtype) if dtype else (getattr(config, "dtype", None) or torch.float32)
    if isinstance(torch_dtype, str):
        torch_dtype = getattr(torch, torch_dtype)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, **from_config)
    if generation:
        built.generation_config.update(**generation)
    return built, torch_dtype


def _quantize(model, quantization: str) -> None:
    """Quantize the linear weights as ``from_pretrained(quantization_config=TorchAoConfig(...))`` does with hf_tpu."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    if quantization == "int8":
        quantize_(model, Int8WeightOnlyConfig())
        return
    if quantization == "int4":
        from hf_tpu.quantization import _integration

        _integration.install_torchao_handlers()
        quantize_(model, Int4WeightOnlyConfig(group_size=128))
        return
    raise InvalidArgumentError(f"quantization {quantization!r}: use int8, int4 or fp8")


def _fp8_layout(model) -> None:
    """The layout of a fine-grained fp8 checkpoint (``float8_e4m3fn`` weights, a float32 scale per 128x128 block) as
    transformers loads it into ``FP8Linear`` (the output head stays unquantized, as its quantizer keeps it); hf_tpu
    runs those modules with the blocks dequantized inside the graph (hf_tpu.quantization.fp8)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    replace_with_fp8_linear(
        model, modules_to_not_convert=["lm_head"], quantization_config=FineGrainedFP8Config(), pre_quantized=True
    )


def lower_generate(
    session,
    model: str,
    dtype: str | None = None,
    batch: int = 1,
    max_prompt_len: int = 128,
    max_new_tokens: int = 32,
    buckets: str = "largest",
    quantization: str | None = None,
    capacity: int | None = None,
    generation: dict | None = None,
    experts_implementation: str | None = None,
    attn_implementation: str | None = None,
    num_beams: int | None = None,
) -> dict[str, Any]:
    """Lower the graphs ``hf_tpu.warmup`` compiles for this call size (``buckets="largest"``: the bucket of
    ``max_prompt_len`` only; ``"all"``: the whole ladder up to it; ``num_beams``: the beam-search graphs too). Returns
    labels and facts for the plan; lowers nothing when the weights alone exceed ``capacity``.

    It is the entry :func:`~hf_tpu.tpu_compile.plan_generate` runs through
    :func:`~hf_tpu.tpu_compile.lower_and_compile`, in the lowering process.

    Args:
        session: the lowering session of that process (its ``mode`` records the programs).
        model: a model directory or its ``config.json`` (no weights are read).
        dtype: the weights' dtype name (``"bfloat16"``); None keeps the config's.
        batch: the batch size; 1 by default.
        max_prompt_len: the longest prompt, in tokens; 128 by default.
        max_new_tokens: tokens generated per call; 32 by default.
        buckets: ``"largest"`` (the default) or ``"all"``, see above.
        quantization: ``"int8"``, ``"int4"`` (weight-only, torchao) or ``"fp8"`` (fine-grained layout); None: none.
        capacity: the device's HBM in bytes; weights and KV cache above it skip the lowering. None: no check.
        generation: generation_config fields to set first; None: none.
        experts_implementation: passed to the model's config (``"ragged_dot_tpu"``, hf_tpu's ``"hf_tpu_measured"``,
            ``"hf_tpu_dense"``, ``"hf_tpu_slots"``, or transformers' own); None: the default.
        attn_implementation: passed to the model's config; None: the default.
        num_beams: also lower the beam-search graphs for this many beams; None: greedy/sampling only.

    Returns:
        The plan's facts: ``model_type``, ``parameters``, ``dtype``, ``prompt_bucket``, ``kv_cache_estimate``,
        ``weights_bytes``, and either ``skipped`` (why nothing was lowered) or the graphs' ``labels`` and
        ``graph_keys``, ``kv_cache_bytes``, ``warmup_seconds`` and ``experts_implementation`` (what the model's
        experts ran: a MoE left at transformers' default gets hf_tpu's measured choice in warm-up).
    """
    import torch

    from hf_tpu._patch import enable
    from hf_tpu.transformers import generation as gen
    from hf_tpu.transformers._graph_key import public_key
    from hf_tpu.transformers.buckets import default_ladder
    from hf_tpu.transformers.warmup import warmup

    if experts_implementation:
        from hf_tpu.kernels import experts_forms

        experts_forms.register_named(experts_implementation)
    extra_args = {"experts_implementation": experts_implementation} if experts_implementation else {}
    if attn_implementation:
        extra_args["attn_implementation"] = attn_implementation
    built, torch_dtype = build_deferred(model, dtype, generation, **extra_args)
    if experts_implementation:  # asked for: warm-up keeps it (it gives a default grouped_mm the measured choice)
        from hf_tpu.kernels.experts_forms import KEEP

        built.__dict__[KEEP] = True
    ladder = default_ladder(built.config)
    bucket = ladder.bucket(max_prompt_len, "the prompt")
    info: dict[str, Any] = {
        "model_type": built.config.model_type,
        "parameters": sum(p.numel() for p in built.parameters()),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "prompt_bucket": bucket,
        "prompt_buckets": list(ladder.rungs),
        "kv_cache_estimate": _kv_estimate(built.config, batch, bucket + max_new_tokens, torch_dtype),
    }
    if quantization == "fp8":
        with torch.device("meta"):
            _fp8_layout(built)
    if quantization in (None, "fp8"):
        info["weights_bytes"] = weight_bytes(built)
        if capacity is not None and info["weights_bytes"] + info["kv_cache_estimate"] > capacity:
            info["skipped"] = "the weights and KV cache alone exceed the chip's HBM: nothing was lowered"
            return info
    info["gathered_embedding_bytes"] = _gathered_embedding_bytes(built)
    embed = getattr(built.get_input_embeddings(), "weight", None)
    info["gathered_embedding_parameters"] = embed.numel() if info["gathered_embedding_bytes"] and embed is not None else 0
    info.update(_experts_facts(built))
    enable()
    built = built.to_empty(device="tpu").eval()
    with session.mode, torch.no_grad():
        if quantization in ("int8", "int4"):
            _quantize(built, quantization)
            info["weights_bytes"] = weight_bytes(built)
            if capacity is not None and info["weights_bytes"] + info["kv_cache_estimate"] > capacity:
                info["skipped"] = "the weights and KV cache alone exceed the chip's HBM: nothing was lowered"
                return info
        # "largest": one prompt bucket; the rungs above it stay for the cache (prompt + new tokens)
        extra = {"buckets": [bucket, *ladder.at_least(bucket + 1)]} if buckets == "largest" else {}
        report = warmup(
            built, max_prompt_len=max_prompt_len, batch_sizes=[batch], max_new_tokens=max_new_tokens, progress=False,
            num_beams=num_beams, **extra,
        )  # fmt: skip
    keys = gen.model_state(built).compile_log  # (the keys as built: compiled_graphs gives them as text)
    decodes = sum(1 for k in keys if k.kind.base == "decode")
    info["labels"] = [label(k, decodes) for k in keys]
    info["graph_keys"] = [list(public_key(k)) for k in keys]
    sizes = gen.cache_bytes(built)
    info["kv_cache_bytes"] = max(sizes.values()) if sizes else 0
    info["warmup_seconds"] = report.seconds
    info["experts_implementation"] = getattr(built.config, "_experts_implementation", None)
    return info
