"""Embeddings and classification with a BERT-like encoder on the TPU: bucketed, compiled once per bucket.

    HF_TPU_SIMULATE=1 python examples/encoders.py

A tiny BERT (built here, nothing downloaded) embeds 64 texts of mixed lengths through
``pipeline("feature-extraction", device="tpu")``, after ``hf_tpu.encoders.warmup``; the same texts go through the
CPU for comparison. With sentence-transformers installed (``pip install -e ".[encoders]"``),
``SentenceTransformer(path, device="tpu").encode`` does the same. Prints the compiles after warm-up (0) and the
largest difference from the CPU.
"""

import tempfile

import torch

import hf_tpu
import hf_tpu.encoders
import hf_tpu.sim
from hf_tpu.testing import ENCODER_WORDS, tiny_encoder


def corpus(n: int = 64) -> list[str]:
    g = torch.Generator().manual_seed(0)
    words = ENCODER_WORDS[5:]
    return [" ".join(words[int(i)] for i in torch.randint(0, len(words), (int(k),), generator=g))
            for k in torch.randint(1, 61, (n,), generator=g)]  # fmt: skip


def main() -> None:
    from transformers import pipeline

    hf_tpu.enable()
    path = tempfile.mkdtemp()
    tiny_encoder("bert", path)  # a tiny BERT and its word-level tokenizer, saved with save_pretrained
    texts = corpus()

    cpu = pipeline("feature-extraction", model=path, device="cpu")
    tpu = pipeline("feature-extraction", model=path, device="tpu")
    print(hf_tpu.encoders.warmup(tpu.model, max_length=64, batch_sizes=[1, 16], progress=False))
    with hf_tpu.sim.stats() as s:
        got = tpu(texts, batch_size=16)
    want = cpu(texts, batch_size=16)
    diff = max((torch.tensor(g) - torch.tensor(w)).abs().max().item() for g, w in zip(got, want))
    print(f"feature-extraction: {len(texts)} texts, {s.compiles} compiles after warm-up, max difference {diff:.1e}")

    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("sentence-transformers is not installed: pip install -e '.[encoders]' to embed through it too")
        return
    st_cpu, st_tpu = SentenceTransformer(path, device="cpu"), SentenceTransformer(path, device="tpu")
    hf_tpu.encoders.warmup(st_tpu[0].auto_model, max_length=64, batch_sizes=[32], progress=False)
    with hf_tpu.sim.stats() as s:
        got = st_tpu.encode(texts, batch_size=32, convert_to_tensor=True).cpu()
    diff = (got - st_cpu.encode(texts, batch_size=32, convert_to_tensor=True)).abs().max().item()
    print(f"sentence-transformers: {s.compiles} compiles after warm-up, max difference {diff:.1e}")


if __name__ == "__main__":
    main()
