"""Encoders on the chip (hf_tpu's bucketed encoder forward): a tiny BERT's features and a classifier's logits against
the CPU's, at the device's default float32 matmul precision and its tolerance (hf_tpu.numerics)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.chip


def _batch(path):
    from transformers import AutoTokenizer

    from hf_tpu.testing import ENCODER_WORDS

    words = ENCODER_WORDS[5:]
    texts = [" ".join(words[(7 * i + 3 * j) % len(words)] for j in range(n)) for i, n in enumerate((3, 17, 9))]
    return AutoTokenizer.from_pretrained(path)(texts, padding=True, return_tensors="pt")


def test_bert_feature_extraction_equals_cpu(tpu, chip, tmp_path):
    import torch
    from transformers import AutoModel

    from hf_tpu.testing import tiny_encoder

    tiny_encoder("bert", tmp_path)
    cpu = AutoModel.from_pretrained(tmp_path).eval()
    model = AutoModel.from_pretrained(tmp_path, device_map="tpu").eval()
    batch = _batch(tmp_path)
    with torch.no_grad():
        got = model(**{k: v.to("tpu") for k, v in batch.items()})
        want = cpu(**batch)
    chip.close(got.last_hidden_state, want.last_hidden_state, layers=4, what="the last hidden state")
    chip.close(got.pooler_output, want.pooler_output, layers=5, what="the pooler output")


def test_bert_classification_logits_and_labels_equal_cpu(tpu, chip, tmp_path):
    """A tiny BERT sequence classifier: logits within the tolerance, and the CPU's label for every text whose two
    best logits are further apart than the tolerance (a closer pair may swap at a reduced precision)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from hf_tpu.numerics import float32_tolerance
    from hf_tpu.testing import tiny_encoder

    tiny_encoder("bert", tmp_path, head="AutoModelForSequenceClassification")
    cpu = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path, device_map="tpu").eval()
    batch = _batch(tmp_path)
    with torch.no_grad():
        got = model(**{k: v.to("tpu") for k, v in batch.items()}).logits.cpu()
        want = cpu(**batch).logits
    chip.close(got, want, layers=5, what="the classification logits")
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * float32_tolerance(layers=5) * float(want.abs().max())
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_feature_extraction_pipeline_equals_cpu(tpu, chip, tmp_path):
    """transformers' ``pipeline("feature-extraction", device="tpu")`` over texts of mixed lengths."""
    import torch
    from transformers import pipeline

    from hf_tpu.testing import ENCODER_WORDS, tiny_encoder

    tiny_encoder("bert", tmp_path)
    words = ENCODER_WORDS[5:]
    texts = [" ".join(words[(5 * i + j) % len(words)] for j in range(n)) for i, n in enumerate((2, 11, 30, 6))]
    got = pipeline("feature-extraction", model=str(tmp_path), device="tpu")(texts)
    want = pipeline("feature-extraction", model=str(tmp_path), device="cpu")(texts)
    for g, w in zip(got, want, strict=True):
        chip.close(torch.tensor(g), torch.tensor(w), layers=4, what="the pipeline's features")
