"""The architecture sweep's tiny models: each causal-LM architecture's config class, its defaults shrunk.

:func:`tiny_config` takes the config class's defaults and sets :data:`SHRINK`'s fields that it has (hidden 64,
4 layers, 4 heads, 4 experts, 128 tokens of vocabulary, ...), then makes the shrunk config consistent by rules read
from its fields: a layer pattern keeps each layer kind of the defaults' (a hybrid's attention layer, a KV-sharing
model's producer of each kind), a partial rotary keeps its share of the shrunk head, top-k stays within the shrunk
experts, counts the defaults leave None (a checkpoint sets them) get numbers, RoPE keyed per layer kind covers every
kind, a size the defaults leave 0 (a NoPE attention's rotary width) stays 0, a list of sizes per kind of block is
scaled down entry by entry. Sub-configs (a multimodal model's towers, BLT's four models) are shrunk alike (keeping
their model type), and a field naming a width of another sub-model follows it (a quantizer's codebook width, its
own); a heterogeneous config's per-layer overrides are scaled as their fields' global values
were. :data:`_OVERRIDES` holds the few upstream defaults that no checkpoint has and no rule can derive, each with
its reason. :func:`build_model` builds the architecture's causal-LM class from such a config.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["SHRINK", "VOCAB", "build_model", "tiny_config"]

VOCAB = 128

# Config fields shrunk when the config class has them (its defaults otherwise).
SHRINK: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_layers": 4,
    "n_layer": 4,
    "n_layers": 4,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "n_embd": 64,
    "d_model": 64,
    "emb_dim": 64,  # XLM
    "d_inner": 128,  # XLNet's feed-forward
    "intermediate_size": 128,
    "ffn_dim": 128,
    "n_inner": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "n_group": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "max_position_embeddings": 512,
    "n_positions": 512,
    "sliding_window": 16,
    "sliding_window_size": 16,
    # a second attention's sizes (sliding layers of their own shape), and a vocabulary's unpadded part
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "unpadded_vocab_size": VOCAB,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "state_size": 16,
    "ssm_state_size": 16,
    "mamba_d_state": 16,
    "num_heads": 8,  # Mamba-2's heads: num_heads * head_dim == hidden_size * expand
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "n_groups": 1,
    "mamba_n_groups": 1,
    # hybrids: attention in the shrunk depth too (their defaults place it past layer 4, or nowhere)
    "attn_layer_indices": [1, 3],
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    # encoder-decoder: equal depths and heads (the decoder's cache is sized by the config's layer count)
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    # looped models (input layers, a looped middle, output layers): one of each end in the shrunk depth
    "n_input_layers": 1,
    "n_output_layers": 1,
}
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_WIDTHS = ("hidden_size", "n_embd", "d_model")
# Fields that name a width of the model or of another sub-model (BLT's hidden_size_global, an adapter's ends): where
# their default is one of the defaults' widths, they follow it to the shrunk width.
_LINKED_WIDTH = re.compile(r"hidden_size|^adapter_")
# Fields the defaults leave None (a checkpoint's config.json sets them) that the model needs as numbers.
_IF_NONE: dict[str, Any] = {"num_key_value_heads": SHRINK["num_attention_heads"], "n_shared_experts": 1}
# Upstream defaults no checkpoint has, that no rule can derive: each names the field the model reads and its
# documented meaning (a sub-config's fields in a nested dict).
_OVERRIDES: dict[str, dict[str, Any]] = {
    # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig does not define, and clamps q/k/v by
    # clip_qkv, which it defaults to None (DBRX's checkpoint: 8)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # Kimi's linear attention is sized by fields of its own (32 heads of 128 by default, where Bailing derives its
    # from the attention's): shrunk as the attention
    "kimi_linear": {"linear_num_heads": 4, "linear_head_dim": 16},
    # the class leaves layer_types None (a checkpoint lists them): LFM2's conv blocks and attention alternating
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * 2},
    # the indexed attention layers need the QSA indexer's sizes (None by default); one KV head, as the class demands
    "qwen4_exp_text": {
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
    },
    # Apertus 1.5's vocabulary holds the text's ids, then the image codebook's, then the audio codebook's (its
    # validator: image offset + image codebook == audio offset, audio offset + audio codebook <= vocabulary): both
    # codebooks shrunk to 16 entries after 64 text ids; the VQ image tokenizer's convolutions shrunk to 32 channels
    # (its group norms' 32 groups), one residual block per stage (its stages, hence its 16x downsampling and its
    # attention stage, kept)
    "apertus1p5": {
        "image_token_offset": 64,
        "audio_token_offset": 80,
        "vision_config": {
            "codebook_size": 16,
            "embed_dim": 16,
            "latent_channels": 32,
            "base_channels": 32,
            "num_res_blocks": 1,
        },
        "audio_config": {"codebook_size": 16},
    },
    # ReformerModelWithLMHead asserts is_decoder (causal self-attention)
    "reformer": {"is_decoder": True},
    # X-MOD's adapters need a language to route through: the defaults' only one
    "xmod": {"default_language": "en_XX"},
    # Zamba ties its shared attention block across the hybrid layers and refuses a pattern with one: its first three
    # layers are fixed (two Mamba, one hybrid), the offset puts the fourth on the period too
    "zamba": {"attn_layer_offset": 0},
    # xLSTM's config rounds the q/k and v widths (hidden_size * factor) up to multiples of 64 for its cache, the
    # model does not: a width at which both agree (0.5 * 128 = 64)
    "xlstm": {"hidden_size": 128, "embedding_dim": 128},
    # MusicGen's decoder reads its input as one row per codebook (one codebook: a prompt row is a sequence), and its
    # generate starts the delay pattern from decoder_start_token_id (a checkpoint's generation config sets it)
    "musicgen_decoder": {"num_codebooks": 1, "decoder_start_token_id": _TOKENS["pad_token_id"]},
    "musicgen_melody_decoder": {"num_codebooks": 1, "decoder_start_token_id": _TOKENS["pad_token_id"]},
}


def tiny_config(model_type: str) -> Any:
    """The config class's defaults with :data:`SHRINK`'s fields (those it has) and small special-token ids, made
    consistent by the module's rules (its docstring)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    fields = _shrunk(defaults)
    config = _first_valid(cls, fields)
    if _scale_overrides(config, defaults, fields):  # per-layer overrides the class derived, at full size
        config = _first_valid(cls, fields)
    text = config.get_text_config(decoder=True)
    if text is not config and getattr(text, "hidden_size", SHRINK["hidden_size"]) != SHRINK["hidden_size"]:
        key = next((k for k in getattr(cls, "sub_configs", {}) if getattr(config, k, None) is text), "text_config")
        fields[key] = _shrunk(text.to_dict())  # a sub-config the class builds by default
        config = _first_valid(cls, fields)
        text = config.get_text_config(decoder=True)
    # (an image-text-to-text config without a causal-LM class: hf_tpu/benchmarks/vlm_sweep.py)
    wanted = MODEL_FOR_CAUSAL_LM_MAPPING[cls].config_class if cls in MODEL_FOR_CAUSAL_LM_MAPPING else None
    if type(text) is not cls and type(text) is wanted and not hasattr(config, "text_config"):
        # the causal-LM class takes a decoder sub-config that upstream's auto class does not pick out (MusicGen's
        # `decoder`, where it picks `text_config`): the sub-config itself
        config = text
    layer_types = getattr(config, "layer_types", None)
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layer_types, list) and layers and len(layer_types) != layers:
        config.layer_types = layer_types = (layer_types * layers)[:layers]
    kinds = list(dict.fromkeys(getattr(type(config)(), "layer_types", None) or ()))
    if isinstance(layer_types, list) and layers and len(kinds) <= layers and set(kinds) - set(layer_types):
        # the shrunk depth lost a layer kind of the defaults' pattern (a hybrid's attention every 6th layer): the
        # first kind, then one layer of each other kind
        config.layer_types = layer_types = kinds[:1] * (layers - len(kinds) + 1) + kinds[1:]
    if isinstance(layer_types, list) and set(layer_types) == {"linear_attention"} and _has_attention(config):
        # a hybrid whose defaults place no attention layer (Granite-4's are all Mamba) though it has attention heads:
        # attention every other layer, as the hybrids' attn_layer_indices above
        config.layer_types = layer_types = ["linear_attention", "full_attention"] * (layers // 2) + [
            "linear_attention"
        ] * (layers % 2)
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if isinstance(layer_types, list) and shared and set(layer_types[: layers - shared]) != set(layer_types):
        # KV sharing (Gemma 3n): the last layers reuse the cache of the last earlier layer of their kind, so every
        # kind needs a producer: each kind once, then each kind again as the sharing layers
        kinds = list(dict.fromkeys(layer_types))
        config.layer_types = layer_types = (kinds * layers)[:layers]
        config.num_kv_shared_layers = max(0, layers - len(kinds))
    _keep_a_loop(config, layers, defaults.get("num_hidden_layers"))
    rope = getattr(config, "rope_parameters", None)
    if isinstance(layer_types, list) and isinstance(rope, dict) and not rope:
        # RoPE parameters keyed per layer kind left empty by the defaults (a checkpoint lists them): the default RoPE
        config.rope_parameters = {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in set(layer_types)}
    return config


def _keep_a_loop(config: Any, layers: Any, full: Any) -> None:
    """A looped architecture (Inkling-2 Loop: layers 6-17 of 24 run ``loop_num_passes`` times, its attention residuals
    in blocks of 6 layers) whose shrunk depth holds none of its looped layers: the loop's bounds and the block size
    scaled with the depth (1-3 of 4, blocks of 1), so that the tiny model loops, with a layer before and after the
    loop as the defaults have (its config wants the bounds to be multiples of the block size)."""
    start, end = getattr(config, "loop_layer_index_start", None), getattr(config, "loop_layer_index_end", None)
    if not all(isinstance(n, int) and n > 0 for n in (start, end, layers, full)) or start < layers:
        return
    scale = layers / full
    block = max(1, round(getattr(config, "n_layers_per_attn_res_block", 1) * scale))
    start = max(block, round(start * scale) // block * block)
    end = min(layers - 1, round(end * scale)) // block * block
    if start < end:
        if hasattr(config, "n_layers_per_attn_res_block"):
            config.n_layers_per_attn_res_block = block
        config.loop_layer_index_start, config.loop_layer_index_end = start, end


def _has_attention(config: Any) -> bool:
    """Whether the config sizes attention layers (attention heads): a ``full_attention`` layer of it builds."""
    return bool(getattr(config, "num_attention_heads", None)) and not hasattr(config, "num_heads")


def _widths(defaults: dict) -> set[int]:
    """The default widths (hidden sizes) of a config and of every sub-config in it."""
    found = {v for k, v in defaults.items() if k in _WIDTHS and isinstance(v, int)}
    for value in defaults.values():
        if _is_sub_config(value):
            found |= _widths(value)
    return found


def _sizes(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of sizes."""
    return isinstance(value, list) and bool(value) and all(type(v) is int and v > 0 for v in value)


def _is_sub_config(value: Any) -> bool:
    return isinstance(value, dict) and "model_type" in value


def _shrunk(defaults: dict, widths: set[int] | None = None) -> dict:
    """The fields of :data:`SHRINK` that ``defaults`` has, its sub-configs shrunk the same way.

    ``widths``: the default widths of the whole config (its sub-configs' too), that a field naming another
    width follows (:data:`_LINKED_WIDTH`)."""
    widths = _widths(defaults) if widths is None else widths
    # (a sliding window, an unpadded vocabulary only where the architecture has one by default)
    optional = ("sliding_window", "sliding_window_size", "unpadded_vocab_size")
    fields = {k: v for k, v in SHRINK.items() if k in defaults and (k not in optional or defaults[k])}
    for name, value in list(fields.items()):
        default = defaults[name]
        if default == 0 and type(default) is int:
            del fields[name]  # a part the architecture leaves out (GLM-5's NoPE attention: no rotary width) stays out
        elif _sizes(default) and len(default) != defaults.get("num_hidden_layers") and 0 < value <= default[0]:
            # one size per kind of block (ERNIE-VL's text and vision experts), not per layer: each scaled down as the
            # first (a list the shrunk value would grow, Florence-2's heads per stage, is left to the class's check)
            fields[name] = [max(1, round(value * size / default[0])) for size in default]
    fields.update({k: v for k, v in _IF_NONE.items() if k in defaults and defaults[k] is None})
    heads = defaults.get("n_head") or defaults.get("num_attention_heads")
    width = defaults.get("n_embd") or defaults.get("hidden_size")
    if isinstance(defaults.get("rotary_dim"), int) and heads and width:
        # partial rotary (GPT-J): the same share of the shrunk head as of the default one, an even count
        share = defaults["rotary_dim"] / (defaults.get("head_dim") or width // heads)
        fields["rotary_dim"] = max(2, int(share * SHRINK["head_dim"]) // 2 * 2)
    split = defaults.get("axial_pos_embds_dim")
    if isinstance(split, list | tuple) and "hidden_size" in fields and sum(split) == defaults["hidden_size"]:
        # a width split into parts that sum to the hidden size (Reformer's axial position embeddings): scaled
        fields["axial_pos_embds_dim"] = [d * fields["hidden_size"] // sum(split) for d in split]
    if "head_dim" in fields and "qk_rope_head_dim" in defaults:  # MLA: rotary embeddings sized by the rope part
        fields["head_dim"] = fields.get("qk_rope_head_dim", defaults["qk_rope_head_dim"])
    if "kv_lora_rank" in defaults and "num_key_value_heads" in fields:
        fields["num_key_value_heads"] = SHRINK["num_attention_heads"]  # MLA: one latent, expanded to every head
    if "layer_types" in defaults:
        fields["layer_types"] = None  # recomputed for the shrunk depth where the class knows how
    if isinstance(defaults.get("layers_block_type"), list) and "hybrid_layer_ids" in defaults:
        # a block pattern listed per layer (Zamba2): each kind of it in the shrunk depth, hybrid blocks last
        kinds = list(dict.fromkeys(defaults["layers_block_type"]))
        pattern = kinds[:1] * (SHRINK["num_hidden_layers"] - len(kinds) + 1) + kinds[1:]
        fields["layers_block_type"] = pattern
        fields["hybrid_layer_ids"] = [i for i, kind in enumerate(pattern) if kind == "hybrid"]
    for name, value in defaults.items():
        if name in fields or name in SHRINK or not isinstance(value, int) or isinstance(value, bool):
            continue
        if _LINKED_WIDTH.search(name) and value in widths:
            # a width that names another one (a sub-model's link to the global model's width, an adapter between
            # towers): it follows the shrunk widths, as the config's validation demands
            fields[name] = SHRINK["hidden_size"]
        elif name == "codebook_dim" and value == defaults.get("hidden_size") and "hidden_size" in fields:
            fields[name] = fields["hidden_size"]  # a quantizer without projections (WavTokenizer): the model's width
        elif name.endswith("_vocab") and value > (defaults.get("vocab_size") or 0):
            fields[name] = VOCAB  # a hashed table's rows (BLT's byte n-grams), larger than the vocabulary
    if defaults.get("per_layer_config") and isinstance(defaults.get("num_hidden_layers"), int):
        # a heterogeneous config: its per-layer lists shrunk with the depth (the class derives the per-layer
        # overrides for the shrunk depth from them; :func:`_scaled_overrides` shrinks those)
        fields.update(_per_layer_lists(defaults, fields.get("num_hidden_layers", defaults["num_hidden_layers"])))
    fields.update({k: v for k, v in _TOKENS.items() if k in defaults})
    for name, value in defaults.items():  # sub-configs (a multimodal model's towers, BLT's four models): alike
        if _is_sub_config(value):
            # (its model type too: a sub-config the class builds through AutoConfig, EXAONE 4.5's text, needs it)
            fields[name] = {"model_type": value["model_type"], **_shrunk(value, widths)}
    for name, value in _OVERRIDES.get(defaults.get("model_type"), {}).items():
        nested = isinstance(value, dict) and isinstance(defaults.get(name), dict)
        fields[name] = {**fields.get(name, defaults[name]), **value} if nested else value
    return fields


def _scale_overrides(config: Any, defaults: dict, fields: dict) -> bool:
    """Put the scaled per-layer overrides (:func:`_scaled_overrides`) of ``config`` and of its sub-configs into
    ``fields``; whether there were any."""
    scaled = _scaled_overrides(config, defaults, fields)
    if scaled is not None:
        fields["per_layer_config"] = scaled
    changed = scaled is not None
    for name, value in fields.items():
        sub = getattr(config, name, None) if isinstance(value, dict) and _is_sub_config(defaults.get(name)) else None
        if sub is not None and hasattr(sub, "to_dict"):
            changed = _scale_overrides(sub, defaults[name], value) or changed
    return changed


def _per_layer_lists(defaults: dict, layers: int) -> dict:
    """The lists of ``defaults`` with an entry per layer of its depth (layer kinds aside: recomputed), for
    ``layers`` layers: the first ones, the last of them replaced by each kind the first ones miss."""
    depth, out = defaults["num_hidden_layers"], {}
    for name, value in defaults.items():
        if name == "layer_types" or not isinstance(value, list) or len(value) != depth or depth <= layers:
            continue
        if not all(isinstance(v, str) for v in value):
            continue
        head = value[:layers]
        missing = [kind for kind in dict.fromkeys(value) if kind not in head]
        out[name] = head[: layers - len(missing)] + missing if missing else head
    return out


def _scaled_overrides(config: Any, defaults: dict, fields: dict) -> dict | None:
    """A heterogeneous config's per-layer overrides (``per_layer_config``) with each size scaled as its field's
    global value was (a layer with twice the global head width keeps twice the shrunk one); an MLA layer's head
    width that was its no-rope and rope parts' sum stays their sum. None where there is nothing to scale."""
    spec = config.__dict__.get("_heterogeneity_spec")
    if spec is None:
        return None
    scaled: dict[int, dict] = {}
    for layer, overrides in spec.per_layer_overrides.items():
        new = dict(overrides)
        for name, value in overrides.items():
            default, shrunk = defaults.get(name), fields.get(name)
            if all(isinstance(v, int) and not isinstance(v, bool) for v in (value, default, shrunk)) and default:
                new[name] = max(1, round(value * shrunk / default))
        merged = {**defaults, **overrides}
        parts = ("qk_nope_head_dim", "qk_rope_head_dim")
        if all(isinstance(merged.get(k), int) for k in ("head_dim", *parts)):
            if merged["head_dim"] == sum(merged[k] for k in parts):
                new["head_dim"] = sum(new.get(k, fields.get(k, defaults[k])) for k in parts)
        scaled[layer] = new
    return scaled if scaled != spec.per_layer_overrides else None


def _first_valid(cls: Any, fields: dict) -> Any:
    """``cls(**fields)``, or with the fewest fields dropped (one, then all but the core sizes) that it accepts."""
    errors = Exception  # transformers' strict config validation raises its own error types
    try:
        return cls(**fields)
    except errors as first:
        for name in reversed(list(fields)):
            try:
                return cls(**{k: v for k, v in fields.items() if k != name})
            except errors:
                continue
        core = {k: v for k, v in fields.items() if k in ("vocab_size", *_TOKENS)}
        try:
            return cls(**core)
        except errors:
            raise first from None


def build_model(model_type: str, config: Any) -> Any:
    """The architecture's causal-LM model for ``config`` (upstream's auto class, or the class it maps the
    architecture to where ``config`` is a decoder sub-config the auto class does not know)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM.from_config(config)
    return MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]._from_config(config)
