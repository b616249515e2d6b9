"""Benchmark: tokens/s of continuous batching with and without a JSON schema, side by side in one run.

A request with a grammar costs the serving loop two things (:mod:`hf_tpu.serving._grammar`): the host computes its
next-token bitmask before every step (llguidance; the rows of a step in parallel) and copies the step's masks to the
device, and the request takes the loop's per-step path (:mod:`hf_tpu.serving._chunks`: one read-back per step instead
of one per K decode steps, since its next mask needs its last token). This benchmark measures what that costs, in
process (no HTTP), on one continuous-batching manager of the shipped tiny-lm, warmed up as ``hf-tpu serve`` warms up
its own (every step shape compiled), on the simulated ``tpu`` device. Three arms, the same prompts, greedy, the same
``max_new_tokens``:

- **A**: no grammar (decode steps in chunks of ``read_back_every`` = K, the default);
- **B**: every request with a JSON schema (an array of records, ``minItems`` long enough that no document ends
  within ``max_new_tokens``; compact JSON, ``configure(json_whitespace=False)``);
- **C**: no grammar, but ``read_back_every=1`` (a read-back each step, as B's loop): A to C is the cost of losing the
  chunked read-backs, C to B the cost of the masks.

At concurrency 32 the requests are added at once; at concurrency 1 they run one after another (``--serial`` of
them). Tokens/s is the tokens generated over the wall time, from the first request added to the last result (a
request without a grammar may end early on its end-of-sequence token: tokens per request are reported). The arms and
concurrencies are interleaved over ``--repeats`` rounds (the order rotated each round) and the medians reported.

For B at the largest concurrency: the host time per step in :meth:`~hf_tpu.serving._grammar.GrammarRows.prepare`
(the matchers' advance, the bitmask fill, the copy to the device) against the wall time per step. Counters: compiles
after warm-up (target 0, from the simulated device), read-backs of the step outputs
(:func:`hf_tpu.serving.read_backs`). Timing target ("missed" when not met; a time depends on the host and its load,
so it never fails the run): tokens/s of B at least ``TARGET_RATIO`` of A's at the largest concurrency. Run::

    hf-tpu bench structured_output                  # concurrency 1 and 32, 3 rounds
    hf-tpu bench structured_output --quick          # 1 round, fewer tokens
    python benchmarks/structured_output.py [same options]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

__all__ = ["QUICK", "SCHEMA", "TARGET_RATIO", "add_arguments", "print_table", "run"]

QUICK = {"repeats": 1, "new_tokens": 32, "serial": 2}
#: at the largest concurrency, tokens/s with a schema over tokens/s without, at least (a timing target)
TARGET_RATIO = 0.7
_WAIT_S = 600  # a bound on each request's result and on the manager's stop, never a timing target
ARMS = {"A": "no grammar", "B": "JSON schema", "C": "no grammar, read_back_every=1"}

#: an array of small records: each record ~ 20 tokens of tiny-lm, ``minItems`` of them outlast ``max_new_tokens``
SCHEMA = {
    "type": "object",
    "properties": {
        "cast": {
            "type": "array",
            "minItems": 16,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 3, "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "role": {"enum": ["king", "queen", "fool", "ghost", "soldier"]},
                    "alive": {"type": "boolean"},
                },
                "required": ["name", "age", "role", "alive"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["cast"],
    "additionalProperties": False,
}
PROMPTS = ["KING HENRY:", "First Citizen:", "ROMEO:", "JULIET:", "HAMLET:", "Enter the ghost.", "O, what a rogue",
           "To be, or not", "MACBETH:", "Good morrow,", "Sirrah,", "My lord,", "Exeunt.", "FALSTAFF:", "What, ho!",
           "Now is the winter", "Alas, poor", "Friends, Romans,", "LEAR:", "Come, come,", "OTHELLO:", "PROSPERO:",
           "Once more unto", "Fair is foul,", "Is this a dagger", "Out, damned spot!", "What light through",
           "All the world's", "Double, double", "The quality of mercy", "Some are born great,",
           "If music be"]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every arm and concurrency (medians)")
    parser.add_argument("--new-tokens", type=int, default=64, help="max_new_tokens of every request")
    parser.add_argument("--serial", type=int, default=4, help="requests run one after another at concurrency 1")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))


class _Timed:
    """Host seconds spent in a method of an object, and its calls (the method replaced on the instance)."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.seconds, self.calls = owner, name, 0.0, 0
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        setattr(owner, name, timed)

    def take(self) -> tuple[float, int]:
        taken = self.seconds, self.calls
        self.seconds, self.calls = 0.0, 0
        return taken

    def remove(self) -> None:
        delattr(self.owner, self.name)


def _manager(args, slots: int):
    import transformers as T

    import llguidance.hf

    from hf_tpu import serving
    from hf_tpu.assets import default_model_path

    serving.configure(slots=slots, max_batch_tokens=max(256, slots * 8), page_size=64, json_whitespace=False)
    path = default_model_path()
    tok = T.AutoTokenizer.from_pretrained(path)
    config = T.GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id or 0, repetition_penalty=1.0)  # fmt: skip
    model = T.AutoModelForCausalLM.from_pretrained(path).eval().to("tpu")
    manager = model.init_continuous_batching(generation_config=config)
    # the grammar rows' llguidance tokenizer, as hf-tpu serve gives them at a first request with a grammar
    manager.logit_processor.grammar.attach(llguidance.hf.from_tokenizer(tok, n_vocab=model.config.vocab_size))
    manager.batch_processor = manager._create_batch_processor()  # as hf-tpu serve warms up: every step shape
    manager.warmup()
    manager.start()
    return tok, manager


def _arm(manager, prompts: list[list[int]], kwargs: dict, concurrency: int, new_tokens: int, count: list) -> dict:
    """Run ``prompts`` through the manager, ``concurrency`` at a time; tokens and wall seconds."""
    from hf_tpu.errors import HfTpuRuntimeError

    tokens, t0 = [], time.perf_counter()
    for start in range(0, len(prompts), concurrency):
        ids = []
        for prompt in prompts[start : start + concurrency]:
            count[0] += 1
            ids.append(f"so{count[0]}")
            manager.add_request(prompt, request_id=ids[-1], max_new_tokens=new_tokens, temperature=0.0, **kwargs)
        for _ in ids:
            result = manager.get_result(timeout=_WAIT_S)
            if result is None or result.error is not None:
                why = "no result" if result is None else result.error
                raise HfTpuRuntimeError(f"structured_output benchmark: a request failed ({why})")
            tokens.append(len(result.generated_tokens))
    return {"seconds": time.perf_counter() - t0, "tokens": sum(tokens), "requests": len(tokens)}


def run(args: argparse.Namespace) -> dict:
    """Measure every arm at every concurrency, interleaved, ``args.repeats`` rounds.

    Returns ``{"new_tokens", "repeats", "serial", "read_back_every", "rows": [{"concurrency", "arms": {arm:
    {tokens_per_s, tokens_per_request, steps, ms_per_step, graph_ms_per_step, host_ms_per_step, rows_ms_per_step,
    grammar_ms_per_step, read_backs}}, "ratio_b_a", "ratio_c_a", "host_only_ratio_b_a"}], "compiles",
    "timing_missed", "targets_met"}``.
    """
    import dataclasses

    import hf_tpu
    import hf_tpu.sim
    from hf_tpu import serving

    hf_tpu.sim.enable()
    saved = dataclasses.asdict(serving.SETTINGS)
    try:
        with hf_tpu.enabled():  # (the manager runs under hf_tpu's serving integration: enabled while it lives)
            runs, every, compiles = _measure(args, max(32, *args.concurrency))
    finally:
        serving.configure(**saved)
    rows = []
    for c in args.concurrency:
        arms = {}
        for a in args.arms:
            rs = runs[c, a]

            def per_step(key: str, rs=rs) -> float:
                return statistics.median(1000 * r[key] / max(1, r["steps"]) for r in rs)

            arms[a] = {
                "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in rs),
                "tokens_per_request": statistics.median(r["tokens"] / r["requests"] for r in rs),
                "steps": statistics.median(r["steps"] for r in rs),
                "read_backs": statistics.median(r["read_backs"] for r in rs),
                "ms_per_step": per_step("seconds"),
                "graph_ms_per_step": per_step("graph_s"),
                "host_ms_per_step": statistics.median(1000 * (r["seconds"] - r["graph_s"]) / max(1, r["steps"])
                                                      for r in rs),  # fmt: skip
                "rows_ms_per_step": per_step("rows_s"),
                "grammar_ms_per_step": per_step("grammar_s"),
            }
        row = {"concurrency": c, "arms": arms}
        for a in ("B", "C"):
            if a in arms and "A" in arms:
                row[f"ratio_{a.lower()}_a"] = arms[a]["tokens_per_s"] / arms["A"]["tokens_per_s"]
        if "A" in arms and "B" in arms:  # B/A were the step graph free: the host's share alone, not a projection
            row["host_only_ratio_b_a"] = arms["A"]["host_ms_per_step"] / arms["B"]["host_ms_per_step"]
        rows.append(row)
    big = max(args.concurrency)
    missed = [f"tokens/s with a schema over without at concurrency {r['concurrency']}: {r['ratio_b_a']:.2f}x, "
              f"target >= {TARGET_RATIO:g}x" for r in rows
              if r["concurrency"] == big and r.get("ratio_b_a", 1.0) < TARGET_RATIO]  # fmt: skip
    return {"new_tokens": args.new_tokens, "repeats": args.repeats, "serial": args.serial, "read_back_every": every,
            "rows": rows, "compiles": compiles, "timing_missed": missed, "targets_met": compiles == 0}  # fmt: skip


def _measure(args, slots: int) -> tuple[dict, int, int]:
    """``({(concurrency, arm): [one dict per round]}, K, compiles after warm-up)``."""
    import dataclasses

    import hf_tpu.sim
    import llguidance

    from hf_tpu import serving

    tok, manager = _manager(args, slots)
    timers = []
    try:
        # the grammar hf-tpu serve makes of a json_schema response_format (compact: json_whitespace=False)
        flexible = bool(serving.SETTINGS.json_whitespace)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": flexible})
        kwargs = {"A": {}, "B": {"grammar": grammar}, "C": {}}
        every = manager.__dict__.get("_hf_tpu_read_back_every", 1)
        sampler = manager.logit_processor
        timers = [_Timed(sampler.grammar, "prepare"),  # the grammar rows' host work (masks and their copy)
                  _Timed(sampler, "prepare_tensor_args"),  # every row's arguments: once per step, so counts them
                  _Timed(manager.batch_processor.model_runner, "compute_batch")]  # the step graph  # fmt: skip
        encoded = [tok(p)["input_ids"] for p in PROMPTS]
        runs = {(c, a): [] for c in args.concurrency for a in args.arms}
        count = [0]
        for c in args.concurrency:  # one untimed pass of each: llguidance's first masks and threads
            for a in args.arms:
                _arm(manager, encoded[: min(c, len(encoded))], kwargs[a], c, 4, count)
        for t in timers:
            t.take()
        order = [(c, a) for c in args.concurrency for a in args.arms]
        with hf_tpu.sim.stats() as s:
            for r in range(args.repeats):
                for c, a in order[r % len(order) :] + order[: r % len(order)]:
                    prompts = [encoded[i % len(encoded)] for i in range(c if c > 1 else args.serial)]
                    manager.__dict__["_hf_tpu_read_back_every"] = 1 if a == "C" else every
                    before = dataclasses.replace(serving.read_backs(manager), reasons={})
                    got = _arm(manager, prompts, kwargs[a], c, args.new_tokens, count)
                    after = serving.read_backs(manager)
                    grammar, rows, graph = (t.take() for t in timers)
                    got["grammar_s"], got["rows_s"], got["steps"], got["graph_s"] = grammar[0], *rows, graph[0]
                    # (read_back_every=1 runs upstream's loop as it is, unrecorded: one read-back per step)
                    got["read_backs"] = got["steps"] if a == "C" else after.read_backs - before.read_backs
                    runs[c, a].append(got)
        manager.__dict__["_hf_tpu_read_back_every"] = every
    finally:
        for t in timers:
            t.remove()
        manager.stop(block=True, timeout=_WAIT_S)
    return runs, every, s.compiles


def print_table(figures: dict) -> None:
    """Print what :func:`run` returned."""
    print(f"\ntiny-lm on the simulated tpu, greedy, max_new_tokens={figures['new_tokens']}, read_back_every="
          f"{figures['read_back_every']} (A, B); medians of {figures['repeats']} interleaved round(s); concurrency 1: "
          f"{figures['serial']} requests one after another. Per step: wall ms = step graph (compute_batch, run on "
          f"the host by the simulator) + host (the rest of the loop), of which row arguments (prepare_tensor_args), "
          f"of which grammar masks (GrammarRows.prepare)\n")  # fmt: skip
    print("| concurrency | arm | tokens/s | vs A | tokens/request | steps | read-backs | wall ms/step | "
          "graph ms/step | host ms/step | row args ms/step | grammar ms/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    big = max(r["concurrency"] for r in figures["rows"])
    for row in figures["rows"]:
        for a, f in row["arms"].items():
            ratio = row.get(f"ratio_{a.lower()}_a")
            cell = "-" if ratio is None else f"{ratio:.2f}x"
            if a == "B" and ratio is not None and row["concurrency"] == big:
                cell += " (missed)" if ratio < TARGET_RATIO else " (ok)"
            print(f"| {row['concurrency']} | {a}: {ARMS[a]} | {f['tokens_per_s']:.1f} | {cell} | "
                  f"{f['tokens_per_request']:.1f} | {f['steps']:g} | {f['read_backs']:g} | {f['ms_per_step']:.1f} | "
                  f"{f['graph_ms_per_step']:.1f} | {f['host_ms_per_step']:.2f} | {f['rows_ms_per_step']:.2f} | "
                  f"{f['grammar_ms_per_step']:.2f} |")  # fmt: skip
    for row in figures["rows"]:
        if "host_only_ratio_b_a" in row:
            print(f"\nconcurrency {row['concurrency']}: host ms/step A over B {row['host_only_ratio_b_a']:.2f}x (B/A "
                  f"if the step graph took no time; on the simulator it takes most of the step)", end="")
    print(f"\n\ncompiles after warm-up: {figures['compiles']} (target 0)")
    for line in figures["timing_missed"]:
        print(f"missed: {line}")
    print(f"target (0 compiles after warm-up): {'ok' if figures['targets_met'] else 'targets missed'}")
