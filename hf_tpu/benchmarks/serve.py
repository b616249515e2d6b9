"""``hf-tpu serve`` under load: a fixed Poisson arrival trace against the server, then the same requests one at a time.

Starts ``hf-tpu serve`` (the shipped model, on the simulated or real TPU) in a child process on 127.0.0.1, waits for
its warm-up, then sends a fixed trace: ``--requests`` completions arriving as a Poisson process of ``--rate``
requests per second (seeded), mixed prompt lengths (1 to 6 phrases) and output lengths (``--min-tokens`` to
``--max-tokens``), all streamed. It reports throughput (generated tokens per second), time to first token p50/p99,
time per output token, and the server's compiles after warm-up (``/metrics``); then sends the same requests one
after another and reports the same figures. Target: the concurrent run takes at most a third of the sequential
time (:data:`TARGET_SPEEDUP`), reported "missed" otherwise; compiles after warm-up must be 0. Last, without HTTP:
the same prompts through ``generate_batch`` in this process, all at once vs one at a time (``--max-tokens`` new
tokens each, no end of sequence), which separates continuous batching's own scaling from the server's.

    hf-tpu bench serve --simulate
    python benchmarks/serve.py --requests 16 --rate 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

__all__ = ["QUICK", "TARGET_SPEEDUP", "add_arguments", "print_table", "run"]

TARGET_SPEEDUP = 3.0
QUICK = {"requests": 16}
_PHRASES = ["The king said", "my lord,", "O Romeo,", "what is the", "I am not", "good morrow,", "why, then"]
_WAIT_S = 1500  # a bound on the server's start, never a timing target


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=32, help="requests in the trace (default: 32)")
    p.add_argument("--rate", type=float, default=16.0, help="Poisson arrival rate, requests/s (default: 16)")
    p.add_argument("--min-tokens", type=int, default=8, help="fewest tokens a request asks for (default: 8)")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens a request asks for (default: 32)")
    p.add_argument("--slots", type=int, default=16, help="the server's --slots (default: 16)")
    p.add_argument("--max-batch-tokens", type=int, default=64, help="the server's --max-batch-tokens (default: 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace (default: 0)")


def trace(a: argparse.Namespace) -> list[dict]:
    """The fixed trace: arrival time (s), prompt and max_tokens of each request."""
    rng = random.Random(a.seed)
    t, out = 0.0, []
    for _ in range(a.requests):
        prompt = " ".join(rng.choice(_PHRASES) for _ in range(rng.randint(1, 6)))
        out.append({"at": t, "prompt": prompt, "max_tokens": rng.randint(a.min_tokens, a.max_tokens)})
        t += rng.expovariate(a.rate)
    return out


def _post_stream(url: str, request: dict) -> dict:
    body = {"prompt": request["prompt"], "max_tokens": request["max_tokens"], "stream": True, "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    start = time.perf_counter()
    first, chunks = None, 0
    with urllib.request.urlopen(req, timeout=_WAIT_S) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if any(c.get("text") for c in payload.get("choices", [])):
                chunks += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    return {"start": start, "ttft": (first or end) - start, "end": end, "tokens": chunks,
            "tpot": (end - first) / (chunks - 1) if first and chunks > 1 else None}  # fmt: skip


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=_WAIT_S) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):  # one model: one line
                return float(line.rsplit(" ", 1)[1])
    return float("nan")


def _figures(results: list[dict], wall: float) -> dict:
    ttft = sorted(r["ttft"] for r in results)
    tpot = sorted(r["tpot"] for r in results if r["tpot"] is not None)
    tokens = sum(r["tokens"] for r in results)

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p99_s": pct(ttft, 0.99), "tpot_p50_s": pct(tpot, 0.5)}  # fmt: skip


def _start_server(a: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--slots", str(a.slots), "--max-batch-tokens", str(a.max_batch_tokens), "--min-step-tokens",
             str(a.max_batch_tokens), "--max-pending", str(max(a.requests, 4 * a.slots))]  # fmt: skip
    from hf_tpu import runtime

    if runtime.detect().mode == "simulated":
        flags.append("--simulate")
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "hf_tpu.cli", "serve", "--port", str(port), *flags],
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + _WAIT_S
    while not _ready(url):  # /health: 503 while the server warms up, 200 once it is ready
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"hf-tpu serve did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    return proc, url


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=_WAIT_S) as r:
            return r.status == 200
    except OSError:  # not listening yet, or 503 (HTTPError is an OSError)
        return False


def in_process(a: argparse.Namespace, requests: list[dict]) -> dict:
    """The same prompts through ``generate_batch`` in this process (no HTTP): all at once vs one at a time."""
    import transformers as T

    import hf_tpu
    from hf_tpu import serving
    from hf_tpu.assets import default_model_path
    from hf_tpu.serving.server import say_once

    hf_tpu.enable()
    serving.configure(slots=a.slots, max_batch_tokens=a.max_batch_tokens, q_min=a.max_batch_tokens)
    quiet = say_once()  # a manager per generate_batch: upstream's warnings about its processors once, not 18 times
    tok = T.AutoTokenizer.from_pretrained(default_model_path())
    model = T.AutoModelForCausalLM.from_pretrained(default_model_path()).eval().to("tpu")
    prompts = [tok(r["prompt"])["input_ids"] for r in requests]
    config = T.GenerationConfig(max_new_tokens=a.max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    common = {"generation_config": config, "progress_bar": False, "persistent_manager": True}
    try:
        model.generate_batch(prompts[:1], **common)  # warm-up
        t0 = time.perf_counter()
        model.generate_batch(prompts, warmup=False, **common)
        together = time.perf_counter() - t0
        t0 = time.perf_counter()
        for p in prompts:
            model.generate_batch([p], warmup=False, **common)
        apart = time.perf_counter() - t0
    finally:
        model.destroy_cached_continuous_batching_manager()
        quiet()
    return {"together_s": together, "one_at_a_time_s": apart, "speedup": apart / together}


def run(a: argparse.Namespace) -> dict:
    from hf_tpu import runtime

    if runtime.detect().mode != "real":  # as every benchmark: the simulated tpu where there is no chip
        import hf_tpu.sim

        hf_tpu.sim.enable()
    requests = trace(a)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start_server(a, Path(tmp) / "serve.log")
        try:
            compiles_at_start = _metric(url, "hf_tpu_compiles_total")
            results: list[dict | None] = [None] * len(requests)

            def send(i):
                delay = requests[i]["at"] - (time.perf_counter() - t0)
                if delay > 0:
                    time.sleep(delay)
                results[i] = _post_stream(url, requests[i])

            t0 = time.perf_counter()
            threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            concurrent = _figures(results, time.perf_counter() - t0)
            t0 = time.perf_counter()
            sequential = _figures([_post_stream(url, r) for r in requests], time.perf_counter() - t0)
            compiles = _metric(url, "hf_tpu_compiles_total") - compiles_at_start
        finally:
            proc.terminate()
            proc.wait(timeout=_WAIT_S)
    speedup = sequential["wall_s"] / concurrent["wall_s"]
    missed = [] if speedup >= TARGET_SPEEDUP else [f"concurrent {speedup:.2f}x faster than sequential, target "
                                                    f"{TARGET_SPEEDUP:g}x"]  # fmt: skip
    return {"requests": len(requests), "rate": a.rate, "concurrent": concurrent, "sequential": sequential,
            "speedup": speedup, "compiles_after_warmup": compiles, "targets_met": compiles == 0,
            "timing_missed": missed, "generate_batch": in_process(a, requests)}  # fmt: skip


def print_table(f: dict) -> None:
    print(f"hf-tpu serve: {f['requests']} requests, Poisson arrivals at {f['rate']:g}/s, streamed")
    print(f"{'run':<12}{'wall s':>9}{'tokens':>8}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'s/token':>9}")
    for name in ("concurrent", "sequential"):
        r = f[name]
        print(f"{name:<12}{r['wall_s']:>9.2f}{r['tokens']:>8}{r['tokens_per_s']:>9.1f}{r['ttft_p50_s']:>10.3f}"
              f"{r['ttft_p99_s']:>10.3f}{r['tpot_p50_s']:>9.3f}")  # fmt: skip
    print(f"compiles after warm-up: {f['compiles_after_warmup']:g} (target 0)")
    verdict = "ok" if not f["timing_missed"] else "missed"
    print(f"concurrent vs sequential: {f['speedup']:.2f}x faster (target >= {TARGET_SPEEDUP:g}x): {verdict}")
    g = f["generate_batch"]
    print(f"without HTTP, generate_batch of the {f['requests']} prompts (--max-tokens new tokens each): "
          f"{g['together_s']:.2f} s together, {g['one_at_a_time_s']:.2f} s one at a time ({g['speedup']:.2f}x)")
    if os.environ.get("HF_TPU_BENCH_DEBUG"):
        print(json.dumps(f, indent=1))
