"""Helpers shared by the device_map tests: the tiny model config and the CPU reference."""

from __future__ import annotations

import torch

import hf_tpu

VOCAB = 96


def tiny_llama_config(tied: bool):
    from hf_tpu.testing import tiny_config

    return tiny_config("llama", vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=tied)


def _save_tokenizer(path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.save_pretrained(path)


def save_tiny_llama(path, tied: bool):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tied))
    model.save_pretrained(path)
    _save_tokenizer(path)
    return path


def cpu_logits(path, input_ids):
    """Reference logits computed on the CPU in the test itself, by upstream code with hf_tpu off."""
    from transformers import AutoModelForCausalLM

    was_on = hf_tpu.is_enabled("device_map")
    if was_on:
        hf_tpu.disable("device_map")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            return model(input_ids).logits
    finally:
        if was_on:
            hf_tpu.enable("device_map")
