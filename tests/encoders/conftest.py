"""Tiny encoders for the encoder tests: built from configs with a word-level tokenizer, saved, loaded back.

The simulated device is on for the whole module, and hf_tpu's ``device_map`` (``pipeline(device="tpu")``) and
``encoders`` integrations with it.
"""

from __future__ import annotations

import pytest
import torch

import hf_tpu
import hf_tpu.sim

VOCAB = 96
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]


def save_tokenizer(path) -> None:
    """A BERT-style word-level tokenizer: ``[CLS] words [SEP]``, token type ids, ``[PAD]`` = 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=128,
    )  # fmt: skip
    tok.save_pretrained(path)


def texts(n: int = 64, seed: int = 0, longest: int = 60) -> list[str]:
    """``n`` texts of 1 to ``longest`` words (mixed lengths, seeded)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (n,), generator=g).tolist()
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 5, (k,), generator=g)) for k in lengths]


CONFIGS = {
    "bert": lambda: __import__("transformers").BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=128, pad_token_id=0, num_labels=3,
    ),
    "xlm-roberta": lambda: __import__("transformers").XLMRobertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=130, pad_token_id=0, bos_token_id=2, eos_token_id=3, num_labels=3,
    ),
    "modernbert": lambda: __import__("transformers").ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2,
        sep_token_id=3, local_attention=8, global_attn_every_n_layers=2, num_labels=3,
    ),
}  # fmt: skip


@pytest.fixture(scope="session")
def encoder_dir(tmp_path_factory):
    """``encoder_dir(family, head="AutoModel") -> path``: a tiny encoder of ``family`` with that head, saved once."""
    import transformers

    made: dict[tuple[str, str], object] = {}

    def make(family: str = "bert", head: str = "AutoModel"):
        if (family, head) not in made:
            torch.manual_seed(0)
            path = tmp_path_factory.mktemp(f"{family}-{head}")
            model = getattr(transformers, head).from_config(CONFIGS[family]())
            model.save_pretrained(path)
            save_tokenizer(path)
            made[family, head] = path
        return made[family, head]

    return make


@pytest.fixture(scope="module", autouse=True)
def _encoders_enabled():
    hf_tpu.sim.enable()
    with hf_tpu.enabled("device_map", "encoders"):
        yield
