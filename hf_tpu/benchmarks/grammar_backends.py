"""Benchmark: the two grammar libraries structured output could use, llguidance and xgrammar, side by side in one run.

hf-tpu serve computes each constrained row's next-token bitmask on the host between two device steps
(:mod:`hf_tpu.serving`'s grammar rows), so what decides between the libraries is the host time per step at a
serving batch, and what installing one costs a CPU host. For each installed library (one that is missing prints
``not installed``), for each vocabulary (``tiny-lm``, the 4,096 tokens of the model the tests serve, and byte-level
BPE tokenizers of 32k and 128k tokens trained here on local Python sources: mask cost grows with the vocabulary) and
for five grammars (three JSON schemas: a flat object, a nested object with an array of objects, a tool call; a regex;
a choice list), it measures:

- tokenizer preparation (llguidance: ``llguidance.hf.from_tokenizer``; xgrammar: ``TokenizerInfo.from_huggingface``
  and a ``GrammarCompiler``);
- grammar compile, to the first mask of a new matcher, for a grammar seen first and for the same grammar again
  (xgrammar caches compiled grammars; llguidance compiles lazily per matcher);
- per step: advance the matcher(s) by one token of a valid document (the schema's example, compact JSON, tokenized by
  the vocabulary) and fill the next-token bitmask (int32 ``[batch, vocab / 32]``), mean and worst over the walk, for
  batch 1 and batch 32 (32 fresh matchers walking in step, filled by llguidance's ``fill_next_token_bitmask_par``
  with an ``LLExecutor`` or xgrammar's ``BatchGrammarMatcher``, both with ``--threads`` threads);
- whether both give the identical bitmask at every step of the walk (both compact, no flexible whitespace, no extra
  properties), and where they differ;
- the install footprint: each library's installed files and those of the packages it requires (from the installed
  distributions' metadata; ``not installed here`` otherwise).

Timing targets ("missed" when not met; a time depends on the host and its load, so it never fails the run): at batch
32, llguidance (the library hf-tpu serve uses) is within ``TARGET_RATIO`` of xgrammar's step time, on each vocabulary.
Count target: every document's tokens are allowed by each library's masks all along its walk. Run::

    hf-tpu bench grammar_backends                  # tiny-lm, 32k, 128k; batches 1 and 32
    hf-tpu bench grammar_backends --quick          # tiny-lm and 32k, one walk
    python benchmarks/grammar_backends.py [same options]

xgrammar pulls torch, transformers and triton: install it away from the project's environment
(``pip install --no-deps --target DIR xgrammar apache-tvm-ffi``) and run with ``PYTHONPATH=DIR``.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["QUICK", "TARGET_RATIO", "add_arguments", "print_table", "run"]

QUICK = {"vocabs": ["tiny-lm", "32k"], "repeats": 1}
#: at batch 32, llguidance's step time over xgrammar's, at most (a timing target)
TARGET_RATIO = 1.5
LIBRARIES = ("llguidance", "xgrammar")
VOCABS = {"tiny-lm": None, "32k": 32_000, "128k": 128_000}
#: what each library declares it needs at install (its wheel's Requires-Dist, Linux x86_64, extras left out)
REQUIRES = {
    "llguidance": (),
    "xgrammar": ("apache-tvm-ffi", "pydantic", "torch", "transformers", "triton", "numpy", "typing-extensions"),
}
_PYDANTIC = ("pydantic-core", "annotated-types", "typing-inspection")  # (pydantic's own requirements)

_FLAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "email": {"type": "string"},
    },
    "required": ["name", "age", "role", "email"],
    "additionalProperties": False,
}
_ITEM = {
    "type": "object",
    "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer"}, "price": {"type": "number"}},
    "required": ["sku", "quantity", "price"],
    "additionalProperties": False,
}
_NESTED = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
            "required": ["name", "city"],
            "additionalProperties": False,
        },
        "items": {"type": "array", "items": _ITEM},
        "paid": {"type": "boolean"},
    },
    "required": ["order_id", "customer", "items", "paid"],
    "additionalProperties": False,
}
_TOOL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "search_web", "send_email"]},
        "arguments": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "location": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["query", "location", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
_REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z [a-z]+\.[a-z]+@[a-z]+\.(com|org|net)"
_CHOICES = ["positive", "negative", "neutral", "mixed"]


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


#: name -> (kind, spec, a document the grammar accepts)
GRAMMARS = {
    "json flat": ("json", _FLAT, _compact({"name": "Ada Lovelace", "age": 36, "role": "editor",
                                           "email": "ada@analytical.engine"})),  # fmt: skip
    "json nested": ("json", _NESTED, _compact({
        "order_id": 40417,
        "customer": {"name": "Grace Hopper", "city": "Arlington"},
        "items": [{"sku": "COBOL-59", "quantity": 2, "price": 19.5}, {"sku": "UNIVAC-1", "quantity": 1, "price": 1200},
                  {"sku": "A-0", "quantity": 12, "price": 0.25}],
        "paid": True,
    })),  # fmt: skip
    "json tool call": ("json", _TOOL, _compact({"name": "get_weather", "arguments": {
        "query": "rain tomorrow afternoon", "location": "Zurich, Switzerland", "days": 3}})),  # fmt: skip
    "regex": ("regex", _REGEX, "2026-03-14T09:26:53Z ada.king@math.org"),
    "choice": ("choice", _CHOICES, "neutral"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--vocabs", nargs="+", choices=list(VOCABS), default=list(VOCABS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=3, help="walks per grammar, batch and library (fresh matchers)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="mask threads at batch > 1")
    parser.add_argument("--corpus-mb", type=float, default=40.0,
                        help="MB of local Python sources the BPE vocabularies are trained on")  # fmt: skip


# --- vocabularies ------------------------------------------------------------------------------------------------


def _corpus(limit_bytes: int) -> list[str]:
    """Local Python sources, the standard library's first, then the environment's packages, up to ``limit_bytes``."""
    stdlib = Path(os.__file__).parent
    roots = [stdlib] + [Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    files, total = [], 0
    for root in roots:
        for path in sorted(glob.glob(str(root / "**" / "*.py"), recursive=True)):
            if total >= limit_bytes:
                return files
            if "/test/" in path or "/tests/" in path:
                continue
            files.append(path)
            total += os.path.getsize(path)
    return files


def _bpe(size: int, corpus_mb: float):
    """A byte-level BPE fast tokenizer of ``size`` tokens (``<|endoftext|>`` its eos) trained on local sources; kept in
    the temporary directory, so that a second run reads it back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    cache = Path(tempfile.gettempdir()) / "hf_tpu_grammar_bench" / f"bpe-{size}-{corpus_mb:g}mb.json"
    if not cache.exists():
        files = _corpus(int(corpus_mb * 1e6))
        print(f"training a {size:,}-token byte-level BPE on {len(files):,} local .py files ...", flush=True)

        def texts():
            for path in files:
                with open(path, encoding="utf-8", errors="ignore") as f:
                    yield f.read()

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<|endoftext|>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
        tok.train_from_iterator(texts(), trainer)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(cache))
    return PreTrainedTokenizerFast(tokenizer_file=str(cache), eos_token="<|endoftext|>")


def _tokenizer(name: str, corpus_mb: float):
    if VOCABS[name] is None:
        from transformers import AutoTokenizer

        import hf_tpu

        return AutoTokenizer.from_pretrained(Path(hf_tpu.__file__).parent / "assets" / "tiny-lm")
    return _bpe(VOCABS[name], corpus_mb)


# --- the two libraries, behind one small interface ----------------------------------------------------------------


class _LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def grammar(self, kind: str, spec) -> str:
        m = self.ll.LLMatcher
        if kind == "json":
            return m.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False, "item_separator": ",",
                                                              "key_separator": ":"})  # fmt: skip
        if kind == "regex":
            return m.grammar_from_regex(spec)
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))

    def matcher(self, grammar: str):
        matcher = self.ll.LLMatcher(self.tok, grammar)
        if matcher.is_error():
            from hf_tpu.errors import InvalidArgumentError

            raise InvalidArgumentError(f"llguidance does not compile the benchmark's grammar: {matcher.get_error()}")
        return matcher

    def advance(self, matchers: list, token: int) -> bool:
        return all([m.consume_token(token) for m in matchers])

    def fill(self, matchers: list, mask) -> None:
        if len(matchers) == 1:
            self.lt.fill_next_token_bitmask(matchers[0], mask, 0)
        else:
            self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)


class _XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, threads: int) -> None:
        import xgrammar

        self.xg = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def grammar(self, kind: str, spec):
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(spec, any_whitespace=False, separators=(",", ":"))
        if kind == "regex":
            return c.compile_regex(spec)
        return c.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))

    def matcher(self, compiled):
        return self.xg.GrammarMatcher(compiled)

    def advance(self, matchers: list, token: int) -> bool:
        if len(matchers) == 1:
            return matchers[0].accept_token(token)
        return all(self.batch.batch_accept_token(matchers, [token] * len(matchers)))

    def fill(self, matchers: list, mask) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(mask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, mask)


_BACKENDS = {"llguidance": _LLGuidance, "xgrammar": _XGrammar}


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# --- measurements ---------------------------------------------------------------------------------------------------


def _walk(lib, grammar, tokens: list[int], eos: int, batch: int, words: int, keep: bool):
    """Fresh matchers walk ``tokens`` in step: per step, advance by the previous token (none first) and fill the
    masks. Returns (seconds per step, masks of row 0 per step when ``keep``, every token allowed and accepted)."""
    import torch

    matchers = [lib.matcher(grammar) for _ in range(batch)]
    mask = torch.zeros((batch, words), dtype=torch.int32)
    times, masks, ok = [], [], True
    for step in range(len(tokens) + 1):
        t0 = time.perf_counter()
        if step:
            ok &= bool(lib.advance(matchers, tokens[step - 1]))
        lib.fill(matchers, mask)
        times.append(time.perf_counter() - t0)
        want = tokens[step] if step < len(tokens) else eos
        ok &= bool((int(mask[0, want >> 5]) >> (want & 31)) & 1)
        if keep:
            masks.append(mask[0].clone())
    return times, masks, ok


def _vocabulary(name: str, args, libs: list[str]) -> dict:
    import torch

    tokenizer = _tokenizer(name, args.corpus_mb)
    vocab = len(tokenizer)
    words = (vocab + 31) // 32
    eos = tokenizer.eos_token_id
    out = {"vocab": name, "tokens": vocab, "prepare_s": {}, "grammars": []}
    backends = {}
    for lib in libs:
        t0 = time.perf_counter()
        backends[lib] = _BACKENDS[lib](tokenizer, vocab, args.threads)
        out["prepare_s"][lib] = time.perf_counter() - t0
    for gname, (kind, spec, doc) in GRAMMARS.items():
        tokens = tokenizer.encode(doc, add_special_tokens=False)
        row = {"grammar": gname, "doc_tokens": len(tokens), "libs": {}}
        print(f"{name}: {gname} ({len(tokens)} tokens) ...", flush=True)
        for lib, backend in backends.items():
            fig = {}
            for label in ("compile_first_ms", "compile_again_ms"):
                t0 = time.perf_counter()
                grammar = backend.grammar(kind, spec)
                matcher = backend.matcher(grammar)
                backend.fill([matcher], torch.zeros((1, words), dtype=torch.int32))
                fig[label] = 1000 * (time.perf_counter() - t0)
            fig["accepted"] = True
            for batch in args.batches:
                first, later = [], []
                for r in range(args.repeats):
                    times, masks, ok = _walk(backend, grammar, tokens, eos, batch, words, keep=(batch == 1 and r == 0))
                    first.append(times[0])
                    later += times[1:]
                    fig["accepted"] &= ok
                    if masks:
                        fig["masks"] = masks
                fig[f"b{batch}"] = {"first_ms": 1000 * statistics.fmean(first),
                                    "mean_ms": 1000 * statistics.fmean(later), "max_ms": 1000 * max(later)}
            row["libs"][lib] = fig
        if len(row["libs"]) == 2 and all("masks" in f for f in row["libs"].values()):
            row["diff"] = _differences(tokenizer, row["libs"]["llguidance"]["masks"],
                                       row["libs"]["xgrammar"]["masks"], tokens)  # fmt: skip
        for fig in row["libs"].values():
            fig.pop("masks", None)
        out["grammars"].append(row)
    return out


def _differences(tokenizer, ll_masks, xg_masks, tokens) -> dict:
    """Steps whose masks differ, and for the first one a few tokens only one library allows."""
    import torch

    differ = [i for i, (a, b) in enumerate(zip(ll_masks, xg_masks, strict=True)) if not torch.equal(a, b)]
    found = {"steps": len(ll_masks), "differ": len(differ),
             "ll_subset": sum(not bool((ll_masks[i] & ~xg_masks[i]).any()) for i in differ)}  # fmt: skip
    if differ:
        i = differ[0]
        ids = torch.arange(ll_masks[i].numel() * 32)

        def allowed(m):
            return set(ids[((m[ids >> 5] >> (ids & 31)) & 1).bool()].tolist())

        a, b = allowed(ll_masks[i]), allowed(xg_masks[i])
        prefix = tokenizer.decode(tokens[:i])

        def show(ids_):
            return [tokenizer.convert_ids_to_tokens(t) for t in sorted(ids_)[:4]]

        found["first"] = {"step": i, "after": prefix[-24:], "only_llguidance": len(a - b), "only_xgrammar": len(b - a),
                          "examples_ll": show(a - b), "examples_xg": show(b - a)}  # fmt: skip
    return found


def _installed_bytes(dist: str) -> int | None:
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    total = 0
    for f in d.files or ():
        p = Path(d.locate_file(f))
        if p.is_file():
            total += p.stat().st_size
    return total


def _footprint() -> dict:
    out = {}
    for lib, deps in REQUIRES.items():
        names = [lib, *deps, *(_PYDANTIC if "pydantic" in deps else ())]
        out[lib] = {n: _installed_bytes(n) for n in names}
    return out


def run(args: argparse.Namespace) -> dict:
    """Measure every installed library on every vocabulary and grammar.

    Returns ``{"installed", "threads", "vocabs": [{vocab, tokens, prepare_s, grammars: [{grammar, doc_tokens,
    libs: {lib: {compile_first_ms, compile_again_ms, accepted, b1, b32: {mean_ms, max_ms}}}, diff}]}], "footprint",
    "timing_missed", "targets_met"}``.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    installed = {lib: _installed(lib) for lib in LIBRARIES}
    libs = [lib for lib in LIBRARIES if installed[lib]]
    vocabs = [_vocabulary(name, args, libs) for name in args.vocabs] if libs else []
    missed = []
    big = max(args.batches)
    if len(libs) == 2 and big > 1:
        for v in vocabs:
            ll = statistics.fmean(g["libs"]["llguidance"][f"b{big}"]["mean_ms"] for g in v["grammars"])
            xg = statistics.fmean(g["libs"]["xgrammar"][f"b{big}"]["mean_ms"] for g in v["grammars"])
            v[f"b{big}_ratio"] = ll / xg
            if ll / xg > TARGET_RATIO:
                missed.append(f"{v['vocab']}: llguidance/xgrammar per step at batch {big} {ll / xg:.2f}x, "
                              f"target <= {TARGET_RATIO:g}x")  # fmt: skip
    accepted = all(f["accepted"] for v in vocabs for g in v["grammars"] for f in g["libs"].values())
    return {"installed": installed, "threads": args.threads, "batches": args.batches, "repeats": args.repeats,
            "vocabs": vocabs, "footprint": _footprint(), "timing_missed": missed, "targets_met": accepted}  # fmt: skip


def _mb(n: int | None) -> str:
    return "not installed here" if n is None else f"{n / 1e6:,.1f} MB"


def print_table(figures: dict) -> None:
    """Print what :func:`run` returned."""
    for lib, ok in figures["installed"].items():
        if not ok:
            print(f"{lib}: not installed")
    batches = figures["batches"]
    print(f"\nper step = advance every matcher by one token + fill the int32 [batch, vocab/32] bitmask: the first "
          f"mask of fresh matchers, then the mean (worst) of the later steps, over {figures['repeats']} walk(s) of a "
          f"valid compact document; {figures['threads']} mask threads\n")  # fmt: skip
    head = " | ".join(f"batch {b}: first mask ms, step ms (worst)" for b in batches)
    print(f"| vocab | grammar | doc tokens | library | compile ms, first / again | {head} | identical masks |")
    print("|---|---|---|---|---|" + "---|" * len(batches) + "---|")
    for v in figures["vocabs"]:
        for g in v["grammars"]:
            d = g.get("diff")
            same = "-" if d is None else ("yes" if not d["differ"] else f"no: {d['differ']} of {d['steps']} steps "
                                                                         f"({d['ll_subset']} llguidance's a subset)")
            for lib, f in g["libs"].items():
                cells = " | ".join(f"{f[f'b{b}']['first_ms']:.2f}, {f[f'b{b}']['mean_ms']:.3f} "
                                   f"({f[f'b{b}']['max_ms']:.2f})" for b in batches)  # fmt: skip
                bad = "" if f["accepted"] else " (a document token refused: missed)"
                print(f"| {v['vocab']} ({v['tokens']:,}) | {g['grammar']} | {g['doc_tokens']} | {lib}{bad} | "
                      f"{f['compile_first_ms']:.1f} / {f['compile_again_ms']:.1f} | {cells} | {same} |")  # fmt: skip
    print("\n| vocab | tokenizer preparation, s | per-step ratio llguidance / xgrammar at the largest batch |")
    print("|---|---|---|")
    big = max(batches)
    for v in figures["vocabs"]:
        prep = ", ".join(f"{lib} {s:.2f}" for lib, s in v["prepare_s"].items())
        ratio = v.get(f"b{big}_ratio")
        cell = "-" if ratio is None else f"{ratio:.2f}x" + (" (missed)" if ratio > TARGET_RATIO else "")
        print(f"| {v['vocab']} | {prep} | {cell} |")
    for v in figures["vocabs"]:
        for g in v["grammars"]:
            d = g.get("diff")
            if d and d["differ"]:
                f = d["first"]
                print(f"{v['vocab']} {g['grammar']}: masks differ at {d['differ']} of {d['steps']} steps; first at "
                      f"step {f['step']} after {f['after']!r}: {f['only_llguidance']} tokens only llguidance allows "
                      f"{f['examples_ll']}, {f['only_xgrammar']} only xgrammar {f['examples_xg']}")  # fmt: skip
    print("\ninstall footprint (installed files, from the distributions' metadata):")
    for lib, sizes in figures["footprint"].items():
        known = sum(n for n in sizes.values() if n)
        parts = ", ".join(f"{n} {_mb(s)}" for n, s in sizes.items())
        print(f"  {lib}: {parts}; total of those installed here {known / 1e6:,.1f} MB")
    for line in figures["timing_missed"]:
        print(f"missed: {line}")
    status = "ok" if figures["targets_met"] else "targets missed"
    print(f"\ntarget (every document token allowed by each library's masks along its walk): {status}")
