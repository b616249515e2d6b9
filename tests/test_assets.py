"""The default model that ships in ``hf_tpu/assets``: it loads through the real ``from_pretrained`` and has
learned English (Shakespeare) text, measured against a uniform model and a randomly initialised twin."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu.assets import DEFAULT_MODEL_NAME, default_model_path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The king said", "ROMEO:\n", "What news, my lord?", "I pray you, sir,"]
WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path()).eval()


@pytest.fixture(scope="module")
def random_twin(model):
    """The same architecture with fresh random weights: what a model that learned nothing does."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    twin = AutoModelForCausalLM.from_config(model.config).eval()
    twin.generation_config = model.generation_config
    return twin


@pytest.fixture(scope="module")
def known_words(tokenizer) -> set[str]:
    """Words the tokenizer learned as whole tokens from the training plays, plus the held-out excerpt's words."""
    words = set()
    for token in tokenizer.get_vocab():
        text = tokenizer.convert_tokens_to_string([token]).strip()
        if len(text) >= 2 and text.isalpha():
            words.add(text.lower())
    heldout = (default_model_path() / "heldout.txt").read_text(encoding="utf-8")
    words.update(w.lower() for w in WORD.findall(heldout))
    return words


def _continuations(model, tokenizer) -> list[str]:
    import torch

    out = []
    for prompt in PROMPTS:
        enc = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**enc, do_sample=False, max_new_tokens=40)
        out.append(tokenizer.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    return out


def _known_fraction(texts: list[str], known: set[str]) -> tuple[float, int]:
    words = [w.lower() for text in texts for w in WORD.findall(text)]
    if not words:
        return 0.0, 0
    return sum(w in known for w in words) / len(words), len(words)


def _perplexity(model, tokenizer, text: str, ctx: int = 256) -> float:
    import torch

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = ctx - 1
    rows = [[tokenizer.bos_token_id] + ids[i:i + body] for i in range(0, len(ids) - body + 1, body)]
    x = torch.tensor(rows)
    with torch.no_grad():
        logits = model(input_ids=x).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    return math.exp(nll.item())


def test_default_model_path_is_light_and_complete():
    code = (
        "import sys\n"
        "from hf_tpu.assets import default_model_path\n"
        "p = default_model_path()\n"
        "print(p)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_TPU_SIMULATE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=SAFETY_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path.name == DEFAULT_MODEL_NAME
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "README.md", "heldout.txt"):
        assert (path / name).is_file(), name


def test_tokenizer_special_tokens_and_round_trip(tokenizer, model):
    assert tokenizer.bos_token_id == model.config.bos_token_id == model.generation_config.bos_token_id
    assert tokenizer.eos_token_id == model.config.eos_token_id == model.generation_config.eos_token_id
    assert tokenizer.pad_token_id == model.config.pad_token_id == model.generation_config.pad_token_id
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3
    assert len(tokenizer) == model.config.vocab_size
    text = "Now, fair Hippolyta, our nuptial hour\nDraws on apace;"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_model_is_small_and_real(model):
    size = (default_model_path() / "model.safetensors").stat().st_size
    assert size < 16 * 2**20, f"the shipped model is {size} bytes; it should stay a few MB"
    assert model.config.model_type == "llama"
    stats = json.loads((default_model_path() / "training_stats.json").read_text())
    assert stats["parameters"] == sum(p.numel() for p in model.parameters())


def test_greedy_generation_is_english(model, tokenizer, random_twin, known_words):
    texts = _continuations(model, tokenizer)
    fraction, count = _known_fraction(texts, known_words)
    # English's most frequent words (the, and, I, my, ...), counted in the held-out excerpt: a model that learned
    # the language uses them all the time; one that learned nothing rarely hits them.
    heldout = (default_model_path() / "heldout.txt").read_text(encoding="utf-8")
    frequent = {w for w, _ in Counter(w.lower() for w in WORD.findall(heldout)).most_common(100)}
    common, _ = _known_fraction(texts, frequent)
    random_common, _ = _known_fraction(_continuations(random_twin, tokenizer), frequent)
    report = f"{fraction:.2f} of {count} words known, {common:.2f} frequent (random twin {random_common:.2f}); {texts!r}"
    assert count >= 10 * len(PROMPTS), report
    assert fraction >= 0.8, report
    assert common >= 0.3, report
    assert common - random_common >= 0.2, report
    distinct = {w.lower() for text in texts for w in WORD.findall(text)}
    assert len(distinct) >= 15, report


def test_heldout_perplexity_far_below_uniform(model, tokenizer, random_twin):
    text = (default_model_path() / "heldout.txt").read_text(encoding="utf-8")
    uniform = float(model.config.vocab_size)  # a uniform model's perplexity is the vocabulary size
    ppl = _perplexity(model, tokenizer, text)
    random_ppl = _perplexity(random_twin, tokenizer, text)
    assert ppl < uniform / 10, (ppl, uniform)
    assert ppl < random_ppl / 10, (ppl, random_ppl)


def test_shipped_model_generates_the_same_on_simulated_tpu(model, tokenizer):
    """The README demo's path: the shipped model on the simulated ``tpu`` device, greedy, equals CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_tpu.sim

    hf_tpu.sim.enable()
    enc = tokenizer(PROMPTS[0], return_tensors="pt")
    with torch.no_grad():
        reference = model.generate(**enc, do_sample=False, max_new_tokens=24)
        on_tpu = AutoModelForCausalLM.from_pretrained(default_model_path()).eval().to("tpu")
        out = on_tpu.generate(**{k: v.to("tpu") for k, v in enc.items()}, do_sample=False, max_new_tokens=24)
    assert out.device.type == "tpu"
    assert torch.equal(out.cpu(), reference), (tokenizer.decode(out[0].cpu()), tokenizer.decode(reference[0]))
