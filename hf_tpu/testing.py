"""Tiny transformers models for tests and examples: built from configs, random weights, saved locally.

No Hub access and a few hundred thousand parameters at most, so TPU code can be tested on a laptop or in CI on
hf_tpu's simulated device (``hf_tpu.sim.enable()``), against the same model on the CPU::

    from hf_tpu.testing import tiny_model

    path = tmp_path / "llama"
    cpu = tiny_model("llama", path)                       # saved with save_pretrained
    tpu = AutoModelForCausalLM.from_pretrained(path, device_map="tpu")

Every size is a keyword override of the config (``tiny_config("llama", num_key_value_heads=1)``). Diffusers
pipelines have their own builders in :mod:`hf_tpu.diffusers.testing`. Encoders (BERT, XLM-R, ModernBERT) come
from :func:`tiny_encoder`, with a word-level tokenizer from :func:`tiny_tokenizer` (``w0 w1 ...`` are its words).
"""

from __future__ import annotations

import os
from typing import Any

from hf_tpu.errors import InvalidArgumentError

__all__ = [
    "ENCODER_FAMILIES", "ENCODER_WORDS", "FAMILIES", "left_padded_prompts", "tiny_config", "tiny_encoder", "tiny_model",
    "tiny_tokenizer",
]

# Shared by the decoder families: 2 layers, hidden 32, 4 heads (head_dim 8), 2 KV heads.
_COMMON = {"vocab_size": 128, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
_DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # family: (config class, model class, defaults besides _COMMON)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_DECODER)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_DECODER, "head_dim": 8}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_DECODER, "num_key_value_heads": 1, "head_dim": 8}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256}),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "decoder_start_token_id": 0},
    ),
    # One family per cache layer kind of the bucketed loop (hf_tpu/transformers/_cache/layers.py):
    # sliding window (alternating with full attention; a window shorter than the test prompts)
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            **_DECODER, "head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_DECODER, "head_dim": 8, "sliding_window": 6}),
    # sliding window + MoE: Gemma 4's text model (a dense MLP and 4 experts in every layer, per-layer input
    # embeddings, a wider head on the full-attention layer) and gpt-oss (4 experts, attention sinks)
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {
            **_DECODER, "head_dim": 8, "global_head_dim": 16, "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"], "enable_moe_block": True, "num_experts": 4,
            "top_k_experts": 2, "moe_intermediate_size": 16, "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 128,
        },
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            **_DECODER, "intermediate_size": 16, "head_dim": 8, "sliding_window": 6, "num_local_experts": 4,
            "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # hybrid: Gated DeltaNet linear attention + full attention
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        {
            **_DECODER, "head_dim": 8, "layer_types": ["linear_attention", "full_attention"],
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        },
    ),
    # SSM (Mamba-2): conv + recurrent state only
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        {
            "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 8, "state_size": 8, "n_groups": 2,
            "expand": 2, "conv_kernel": 4, "time_step_rank": 4, "chunk_size": 16,
        },
    ),
    # a recurrent block (its conv and recurrent states kept on its modules, outside the cache) and a local-attention
    # block (a sliding window of 6)
    "recurrent_gemma": (
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        {
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "lru_width": 32, "attention_window_size": 6,
            "block_types": ["recurrent", "attention"],
        },
    ),
    # multi-latent attention (its cache holds the compressed latent) with a dense first layer and a MoE second one
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **_DECODER, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 8, "v_head_dim": 8, "head_dim": 4, "moe_intermediate_size": 16,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 1, "n_shared_experts": 1,
        },
    ),
    # DeepSeek-V3.2 sparse attention: multi-latent attention whose indexer caches keys of its own (StaticIndexedLayer)
    # and keeps the 4 best-scored of them per query, fewer than the test sequences hold; one dense layer (the MoE
    # of this family is DeepSeek-V3's). 8 indexer heads: a key's score sums ReLUs over the heads, and with 2 heads
    # whole groups of keys score exactly 0, a tie at the top-k boundary that topk breaks differently for a cache of
    # another length (upstream's own static cache too)
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        {
            **_DECODER, "num_hidden_layers": 1, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
            "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8, "head_dim": 4, "first_k_dense_replace": 1,
            "index_topk": 4, "index_head_dim": 8, "index_n_heads": 8,
        },
    ),
    # compressed attention (DeepSeek-V4): a heavily compressed (HCA, one entry per 8 tokens) and a compressed sparse
    # (CSA, one per 4, indexer top 2) layer, each over an 8-token sliding window; runs upstream's loop, as HCA can
    # have no bucketed static form (hf_tpu/transformers/_cache/layers.py: NO_STATIC_FORM)
    "deepseek_v4": (
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        {
            **_DECODER, "num_key_value_heads": 1, "head_dim": 16, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8,
            "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "hc_mult": 2,
            "hc_sinkhorn_iters": 3, "sliding_window": 8, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 2,
            "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention"],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        },
    ),
    # multi-query attention: one KV head whatever num_kv_heads says
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "multi_query": True,
         "ffn_hidden_size": 64, "max_position_embeddings": 256},
    ),
    # encoder-decoder with unequal encoder (4) and decoder (2) heads
    "bart": (
        "BartConfig",
        "BartForConditionalGeneration",
        {
            "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
            "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
            "max_position_embeddings": 256, "decoder_start_token_id": 2, "forced_eos_token_id": None,
        },
    ),
    # a looped decoder: its 2 middle layers (sliding window 6, shorter than the test prompts, then full attention)
    # run twice, the second loop writing to copies of their cache layers that the forward appends to the cache
    "dory": (
        "DoryConfig",
        "DoryForCausalLM",
        {
            **_DECODER, "num_hidden_layers": 4, "head_dim": 8, "sliding_window": 6, "n_input_layers": 1,
            "n_output_layers": 1, "n_recurrent_loops": 2,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        },
    ),
    # MoE families with the same expert shapes (hidden 32, expert intermediate 16, 8 experts, top-2)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**_DECODER, "head_dim": 8, "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2},
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {**_DECODER, "intermediate_size": 16, "head_dim": 8, "num_local_experts": 8, "num_experts_per_tok": 2},
    ),
    # MoE whose rotary embedding rebuilds its frequencies at every forward (hf_tpu/transformers/_rope_on_device.py)
    "phimoe": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        {**_DECODER, "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # lightning (linear) attention whose K^T V state lives in MiniMax's own cache class, full attention, MoE; blocks
    # of 4 tokens, so a padded prompt spans several
    "minimax": (
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        {
            **_DECODER, "head_dim": 8, "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
            "layer_types": ["linear_attention", "full_attention"], "block_size": 4,
        },
    ),
}


def _family(family: str) -> tuple[str, str, dict[str, Any]]:
    try:
        return FAMILIES[family]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown tiny model family {family!r}; choose one of {', '.join(FAMILIES)}"
        ) from None


def tiny_config(family: str = "llama", **overrides: Any) -> Any:
    """The config of a tiny ``family`` model (see :data:`FAMILIES`), any field overridden by keyword.

    Args:
        family: a key of :data:`FAMILIES`; ``"llama"`` by default.
        **overrides: config fields to set instead of the tiny defaults.

    Returns:
        A transformers config of the family's config class.

    Raises:
        ValueError: an unknown family (the message lists them).

    Example:
        >>> tiny_config("llama", num_key_value_heads=1).num_key_value_heads
        1
    """
    import transformers

    config_class, _, defaults = _family(family)
    return getattr(transformers, config_class)(**{**_COMMON, **defaults, **overrides})


def tiny_model(
    family: str = "llama", path: str | os.PathLike | None = None, *, seed: int = 0, **overrides: Any
) -> Any:
    """A tiny ``family`` model with weights drawn from ``torch.manual_seed(seed)``, in eval mode on the CPU.

    ``path``: also saved there with ``save_pretrained`` (load it back with ``from_pretrained(path, ...)``).
    ``overrides``: config fields (see :func:`tiny_config`); a ``config`` keyword takes a whole config instead.

    Args:
        family: a key of :data:`FAMILIES`; ``"llama"`` by default.
        path: a folder to save the model to; None (the default) saves nothing.
        seed: the ``torch.manual_seed`` the weights are drawn with; 0 by default.
        **overrides: config fields, or ``config=`` a whole config.

    Returns:
        The model (the family's ``...ForCausalLM`` class), in eval mode on the CPU.

    Raises:
        ValueError (InvalidArgumentError): an unknown family, or ``config=`` together with config fields.

    Example:
        >>> model = tiny_model("qwen3", tie_word_embeddings=True)
        >>> model.lm_head.weight is model.model.embed_tokens.weight
        True
    """
    import torch
    import transformers

    _, model_class, _ = _family(family)
    config = overrides.pop("config", None)
    if config is not None and overrides:
        raise InvalidArgumentError(
            f"tiny_model: pass either config= or config fields ({', '.join(overrides)}), not both"
        )
    config = config if config is not None else tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    if path is not None:
        model.save_pretrained(path)
    return model


# Encoders: 2 layers, hidden 32, 4 heads, 96 words; (config class, defaults). The head is chosen per model.
_ENCODER = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 64, "pad_token_id": 0, "num_labels": 3}  # fmt: skip
ENCODER_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "bert": ("BertConfig", {**_ENCODER, "max_position_embeddings": 128}),
    # RoBERTa-like: positions counted from pad_token_id + 1, hence two more
    "xlm-roberta": ("XLMRobertaConfig", {**_ENCODER, "max_position_embeddings": 130, "bos_token_id": 2,
                                         "eos_token_id": 3}),
    # alternating global and local (a window of 8, shorter than most test inputs) attention
    "modernbert": ("ModernBertConfig", {**_ENCODER, "max_position_embeddings": 128, "bos_token_id": 2,
                                        "eos_token_id": 3, "cls_token_id": 2, "sep_token_id": 3,
                                        "local_attention": 8, "global_attn_every_n_layers": 2}),
    # no token type ids; hidden_size/num_* map to dim/n_*, the feed-forward width is hidden_dim
    "distilbert": ("DistilBertConfig", {**_ENCODER, "max_position_embeddings": 128, "hidden_dim": 64}),
    # embeddings narrower than the hidden size (projected up), as ELECTRA's are
    "electra": ("ElectraConfig", {**_ENCODER, "max_position_embeddings": 128, "embedding_size": 16}),
    # disentangled relative-position attention (position buckets shorter than the test inputs), token types on
    "deberta-v2": ("DebertaV2Config", {**_ENCODER, "max_position_embeddings": 128, "type_vocab_size": 2,
                                       "relative_attention": True, "position_buckets": 16,
                                       "pos_att_type": ["p2c", "c2p"], "position_biased_input": False}),
    # RoBERTa-like positions (two more) and a relative-position bias
    "mpnet": ("MPNetConfig", {**_ENCODER, "max_position_embeddings": 130, "bos_token_id": 2, "eos_token_id": 3}),
}  # fmt: skip
# The words of tiny_tokenizer: the special tokens, then w0, w1, ...
ENCODER_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(_ENCODER["vocab_size"] - 5)]


def tiny_encoder(
    family: str = "bert",
    path: str | os.PathLike | None = None,
    *,
    head: str = "AutoModel",
    seed: int = 0,
    **overrides: Any,
) -> Any:
    """A tiny encoder of ``family`` (see :data:`ENCODER_FAMILIES`) with the transformers auto class ``head``
    (``"AutoModel"``, ``"AutoModelForSequenceClassification"``, ...), weights from ``torch.manual_seed(seed)``, in
    eval mode on the CPU; with ``path``, saved there with :func:`tiny_tokenizer`'s tokenizer beside it.

    Args:
        family: a key of :data:`ENCODER_FAMILIES`; ``"bert"`` by default.
        path: a folder to save the model and tokenizer to; None (the default) saves nothing.
        head: the transformers auto class the model is built with; ``"AutoModel"`` by default.
        seed: the ``torch.manual_seed`` the weights are drawn with; 0 by default.
        **overrides: config fields to set instead of the tiny defaults.

    Returns:
        The model, in eval mode on the CPU.

    Raises:
        ValueError (InvalidArgumentError): an unknown family (the message lists them).

    Example:
        >>> tiny_encoder("bert", head="AutoModelForSequenceClassification").config.num_labels
        3
    """
    import torch
    import transformers

    try:
        config_class, defaults = ENCODER_FAMILIES[family]
    except KeyError:
        known = ", ".join(ENCODER_FAMILIES)
        raise InvalidArgumentError(f"unknown tiny encoder family {family!r}; choose one of {known}") from None
    config = getattr(transformers, config_class)(**{**defaults, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, head).from_config(config).eval()
    if path is not None:
        model.save_pretrained(path)
        tiny_tokenizer(path)
    return model


def tiny_tokenizer(path: str | os.PathLike | None = None) -> Any:
    """A BERT-style word-level fast tokenizer over :data:`ENCODER_WORDS` (``[CLS] words [SEP]``, token type ids,
    ``[PAD]`` = 0), saved to ``path`` when given.

    Args:
        path: a folder to save the tokenizer to; None (the default) saves nothing.

    Returns:
        A ``PreTrainedTokenizerFast`` (``model_max_length`` 128).

    Example:
        >>> tiny_tokenizer()("w0 w1")["input_ids"]
        [2, 5, 6, 3]
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(ENCODER_WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=128,
    )  # fmt: skip
    if path is not None:
        tok.save_pretrained(path)
    return tok


def left_padded_prompts(lengths: list[int], *, vocab: int = 128, seed: int = 0) -> tuple[Any, Any]:
    """A left-padded batch of random prompts of the given lengths, token ids in ``[3, vocab)`` (0 pads):
    ``(input_ids, attention_mask)`` on the host.

    Args:
        lengths: each prompt's length (the batch is as wide as the longest).
        vocab: token ids are drawn below it.
        seed: the CPU generator's seed (the same seed, the same prompts).

    Returns:
        ``(input_ids, attention_mask)``, int64 tensors of shape ``(len(lengths), max(lengths))``.

    Example:
        >>> ids, mask = left_padded_prompts([3, 5], vocab=96)
        >>> ids.shape, mask.tolist()
        (torch.Size([2, 5]), [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask
