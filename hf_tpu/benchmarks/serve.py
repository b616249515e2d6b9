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

With ``--soak`` (:func:`soak`): ``--requests`` (default 2,000) mixed requests at ``--concurrency`` (default 32)
against the same server: chat and completions, streamed and not, greedy and sampled with seeds, ``n`` > 1, stop
strings, logprobs, clients that disconnect mid-stream and invalid bodies (each with the 4xx it must get). It checks
that every valid request is answered (0 lost), 0 5xx, every invalid one gets its 4xx, the server's resident memory
after the last request within :data:`TARGET_RSS_DRIFT` of after the first :data:`SOAK_BASELINE` requests, 0 compiles
after warm-up, and the queue bounded (never above ``--max-pending``, empty at the end, no KV block held); a target
missed is reported "missed", never a timed assertion. Each request has a client timeout of :data:`_WAIT_S` and the
load a deadline (``--soak-deadline``).

    hf-tpu bench serve --simulate
    python benchmarks/serve.py --requests 16 --rate 16
    hf-tpu bench serve --soak                        # 2,000 mixed requests at concurrency 32
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from hf_tpu import _env
from hf_tpu.errors import HfTpuRuntimeError

__all__ = ["QUICK", "SOAK_BASELINE", "TARGET_RSS_DRIFT", "TARGET_SPEEDUP", "add_arguments", "print_table", "run",
           "soak", "soak_requests"]

TARGET_SPEEDUP = 3.0
QUICK = {"requests": 16}
_PHRASES = ["The king said", "my lord,", "O Romeo,", "what is the", "I am not", "good morrow,", "why, then"]
_WAIT_S = 1500  # a bound on the server's start and on each request, never a timing target
#: Resident memory after the soak's last request may differ from after its first :data:`SOAK_BASELINE` by this ratio.
TARGET_RSS_DRIFT = 0.05
SOAK_BASELINE = 200


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--soak", action="store_true",
                   help="the soak: --requests mixed requests (valid, invalid, disconnecting) at --concurrency")
    p.add_argument("--requests", type=int, default=None, help="requests in the trace (default: 32; --soak: 2000)")
    p.add_argument("--concurrency", type=int, default=32, help="--soak: clients at once (default: 32)")
    p.add_argument("--soak-deadline", type=float, default=4 * 3600.0,
                   help="--soak: seconds after which no new request is sent (default: 14400); unsent ones are lost")
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
    for _ in range(a.requests or 32):
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


def _start_server(a: argparse.Namespace, log: Path, max_pending: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--slots", str(a.slots), "--max-batch-tokens", str(a.max_batch_tokens), "--min-step-tokens",
             str(a.max_batch_tokens), "--max-pending", str(max_pending)]  # fmt: skip
    from hf_tpu import runtime

    if runtime.detect().mode == "simulated":
        flags.append("--simulate")
    package_root = str(Path(__file__).resolve().parents[2])  # hf_tpu importable in the child as it is here
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "hf_tpu.cli", "serve", "--port", str(port), *flags],
                                stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + _WAIT_S
        while not _ready(url):  # /health: 503 while the server warms up, 200 once it is ready
            if proc.poll() is not None or time.monotonic() > deadline:
                raise HfTpuRuntimeError(f"hf-tpu serve did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
    except BaseException:
        _stop(proc)
        raise
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server shuts down gracefully), then SIGKILL to its process group if it outlives the bound."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=_WAIT_S)
            return
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # its own session (start_new_session): the server and any child
    proc.wait()


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
    return {"together_s": together, "one_at_a_time_s": apart, "speedup": apart / together,
            "max_new_tokens": a.max_tokens}  # fmt: skip


def run(a: argparse.Namespace) -> dict:
    from hf_tpu import runtime

    if runtime.detect().mode != "real":  # as every benchmark: the simulated tpu where there is no chip
        import hf_tpu.sim

        hf_tpu.sim.enable()
    if a.soak:
        return soak(a)
    requests = trace(a)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start_server(a, Path(tmp) / "serve.log", max(len(requests), 4 * a.slots))
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
            _stop(proc)
    speedup = sequential["wall_s"] / concurrent["wall_s"]
    missed = [] if speedup >= TARGET_SPEEDUP else [f"concurrent {speedup:.2f}x faster than sequential, target "
                                                    f"{TARGET_SPEEDUP:g}x"]  # fmt: skip
    return {"requests": len(requests), "rate": a.rate, "concurrent": concurrent, "sequential": sequential,
            "speedup": speedup, "compiles_after_warmup": compiles, "targets_met": compiles == 0,
            "timing_missed": missed, "generate_batch": in_process(a, requests)}  # fmt: skip


def print_table(f: dict) -> None:
    if f.get("soak"):
        return print_soak(f)
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
    print(f"without HTTP, generate_batch of the {f['requests']} prompts ({g['max_new_tokens']} new tokens each, "
          "--max-tokens): "
          f"{g['together_s']:.2f} s together, {g['one_at_a_time_s']:.2f} s one at a time ({g['speedup']:.2f}x)")
    if _env.BENCH_DEBUG.get():
        print(json.dumps(f, indent=1))


# ----- the soak -----

#: Invalid requests of the soak: (path, body (bytes: sent as is), the status it must get, the field it must name).
_INVALID: list[tuple[str, object, int, str | None]] = [
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/completions", {"prompt": "The king said", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "The king said", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "The king said", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "The king said", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "The king said", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "The king said", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "The king said", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", b'{"prompt": "The king', 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "The king said", "model": "no-such-model"}, 404, "model"),
]  # fmt: skip
_STOPS = [",", ["\n", "."], " the", ["!", "?", ";"]]
_MAX_N = 3  # the most choices a soak request asks for


def soak_requests(n: int, seed: int = 0) -> list[dict]:
    """The soak's fixed mix (seeded): each ``{"kind": "valid" | "disconnect" | "invalid", "path", "body", ...}``.

    About 85% valid (chat or completions, half streamed; greedy, sampled with a seed and top-k/top-p, or the model's
    defaults; some with ``n`` 2-3, stop strings, logprobs, ``ignore_eos``), 5% streams whose client disconnects
    after the first chunk, 10% invalid bodies."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.10:
            path, body, status, param = rng.choice(_INVALID)
            out.append({"kind": "invalid", "path": path, "body": body, "status": status, "param": param})
            continue
        prompt = " ".join(rng.choice(_PHRASES) for _ in range(rng.randint(1, 6)))
        if r < 0.15:  # a long stream (no end of sequence) that its client leaves after the first chunk
            body = {"prompt": prompt, "max_tokens": rng.randint(64, 200), "stream": True, "ignore_eos": True,
                    "temperature": 0}  # fmt: skip
            out.append({"kind": "disconnect", "path": "/v1/completions", "body": body})
            continue
        chat = rng.random() < 0.5
        body: dict = {"max_tokens": rng.randint(1, 24), "stream": rng.random() < 0.5}
        if chat:
            messages = [{"role": "user", "content": prompt}]
            if rng.random() < 0.3:
                messages.insert(0, {"role": "system", "content": rng.choice(_PHRASES)})
            body["messages"] = messages
        else:
            body["prompt"] = prompt
        draw = rng.random()
        if draw < 0.4:
            body["temperature"] = 0
        elif draw < 0.9:
            body.update(temperature=round(rng.uniform(0.5, 1.5), 2), seed=rng.randrange(2**31))
            if rng.random() < 0.5:
                body["top_p"] = rng.choice([0.8, 0.9, 0.95])
            if rng.random() < 0.5:
                body["top_k"] = rng.choice([4, 8, 20])
        # else: the model's generation config
        if rng.random() < 0.15:
            body["n"] = rng.randint(2, _MAX_N)
        if rng.random() < 0.15:
            body["stop"] = rng.choice(_STOPS)
        if rng.random() < 0.15:
            if chat:
                body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
            else:
                body["logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.2:
            body["ignore_eos"] = True
        out.append({"kind": "valid", "path": "/v1/chat/completions" if chat else "/v1/completions", "body": body})
    return out


def _send(port: int, path: str, body, model: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    if isinstance(body, dict):
        body = json.dumps({"model": model, **body} if "model" not in body else body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=_WAIT_S)
    conn.request("POST", path, body, {"content-type": "application/json"})
    return conn, conn.getresponse()


def _answer_problem(request: dict, status: int, payload: bytes | list[dict]) -> str | None:
    """Why a valid request's answer is wrong (None when it is right): its choices, their finish reasons, logprobs."""
    body = request["body"]
    n, chat, stream = body.get("n", 1), "messages" in body, body["stream"]
    wants_logprobs = body.get("logprobs") not in (None, False)
    if status != 200:
        return f"status {status}"
    chunks = payload if stream else [json.loads(payload)]
    finish: dict[int, str] = {}
    tokens: dict[int, int] = {}
    logprobs_seen = set()
    for chunk in chunks:
        for c in chunk.get("choices", []):
            i = c.get("index", 0)
            if c.get("finish_reason"):
                finish[i] = c["finish_reason"]
            text = (c.get("delta") or c.get("message") or {}).get("content") if chat else c.get("text")
            if text:
                tokens[i] = tokens.get(i, 0) + 1
            if c.get("logprobs"):
                logprobs_seen.add(i)
    if sorted(finish) != list(range(n)):
        return f"choices with a finish_reason: {sorted(finish)}, expected {n}"
    if not set(finish.values()) <= {"stop", "length"}:
        return f"finish_reason {finish}"
    if stream and any(count > body["max_tokens"] for count in tokens.values()):
        return f"more chunks than max_tokens: {tokens}"
    usage = chunks[-1].get("usage") if not stream else None
    if usage and usage.get("completion_tokens", 0) > n * body["max_tokens"]:
        return f"completion_tokens {usage['completion_tokens']} above n x max_tokens"
    if wants_logprobs and not logprobs_seen and any(tokens.values()):
        return "logprobs asked for, none returned"
    return None


def _one(port: int, model: str, request: dict) -> dict:
    """Send one soak request (429: retried after its Retry-After, a bounded number of times); what came of it."""
    retries = 0
    while True:
        conn = None
        try:
            conn, response = _send(port, request["path"], request["body"], model)
            if response.status == 429 and retries < 100:
                retries += 1
                response.read()
                time.sleep(float(response.getheader("retry-after") or 1))
                continue
            result = {"kind": request["kind"], "status": response.status, "retries_429": retries, "problem": None}
            if request["kind"] == "disconnect":  # read up to the first chunk, then go away
                line = response.readline()
                while line and not line.startswith(b"data: "):
                    line = response.readline()
                if response.status != 200 or not line:
                    result["problem"] = f"status {response.status}, no chunk before the disconnect"
                return result
            if request["kind"] == "invalid":
                payload = json.loads(response.read() or b"null")
                error = (payload or {}).get("error") if isinstance(payload, dict) else None
                if response.status != request["status"] or not error:
                    result["problem"] = f"expected {request['status']}, got {response.status}: {payload}"
                elif request["param"] is not None and error.get("param") != request["param"]:
                    result["problem"] = f"expected param {request['param']!r}, got {error.get('param')!r}"
                return result
            if request["body"]["stream"] and response.status == 200:
                chunks, done = [], False
                for line in response:
                    if line.strip() == b"data: [DONE]":
                        done = True
                        break
                    if line.startswith(b"data: "):
                        chunks.append(json.loads(line[6:]))
                result["problem"] = None if done else "the stream ended without [DONE]"
                result["problem"] = result["problem"] or _answer_problem(request, 200, chunks)
            else:
                result["problem"] = _answer_problem(request, response.status, response.read())
            return result
        except (OSError, http.client.HTTPException, ValueError) as exc:  # refused, reset, timed out, bad JSON
            return {"kind": request["kind"], "status": None, "retries_429": retries,
                    "problem": f"{type(exc).__name__}: {exc}"}  # fmt: skip
        finally:
            if conn is not None:
                conn.close()


def _metrics(url: str) -> dict[str, float]:
    """The server's /metrics, each name summed over its labels (one model)."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(url + "/metrics", timeout=_WAIT_S) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _rss(proc: subprocess.Popen, url: str) -> float:
    """The server process's resident memory in bytes: /proc when there is one, else its process metric."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
    return _metrics(url).get("process_resident_memory_bytes", float("nan"))


def soak(a: argparse.Namespace) -> dict:
    """The soak (``--soak``): ``--requests`` mixed requests at ``--concurrency``; its figures and checks."""
    from concurrent.futures import ThreadPoolExecutor

    requests = soak_requests(a.requests or 2000, a.seed)
    max_pending = max(4 * a.slots, 2 * a.concurrency + 8)  # above the clients: a closed stream may linger a moment
    stop = threading.Event()  # ends the watcher below, however the soak ends
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start_server(a, Path(tmp) / "serve.log", max_pending)
        try:
            port = int(url.rsplit(":", 1)[1])
            with urllib.request.urlopen(url + "/v1/models", timeout=_WAIT_S) as r:
                model = json.loads(r.read())["data"][0]["id"]
            start = _metrics(url)
            peaks = {"queue": 0.0, "in_flight": 0.0}

            def watch():  # the queue's and the in-flight count's highest values, read once a second
                while not stop.wait(1.0):
                    with contextlib.suppress(OSError, ValueError):
                        m = _metrics(url)
                        peaks["queue"] = max(peaks["queue"], m.get("hf_tpu_queue_depth", 0.0))
                        peaks["in_flight"] = max(peaks["in_flight"], m.get("hf_tpu_requests_in_flight", 0.0))

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            deadline = time.monotonic() + a.soak_deadline

            def one(request):
                if time.monotonic() > deadline:
                    problem = "not sent: --soak-deadline passed"
                    return {"kind": request["kind"], "status": None, "retries_429": 0, "problem": problem}
                return _one(port, model, request)

            def settled() -> dict:
                """The server once the clients are gone: nothing in flight, queued, or holding KV blocks."""
                until = time.monotonic() + _WAIT_S
                while True:
                    m = _metrics(url)
                    idle = m.get("hf_tpu_requests_in_flight", 0) == 0 and m.get("hf_tpu_queue_depth", 0) == 0
                    if (idle and m.get("hf_tpu_kv_blocks_in_use", 0) == 0) or time.monotonic() > until:
                        return m
                    time.sleep(0.5)

            results, rss = [], {}
            t0 = time.perf_counter()
            baseline = min(SOAK_BASELINE, len(requests))
            with ThreadPoolExecutor(a.concurrency) as pool:
                for part, label in ((requests[:baseline], "first"), (requests[baseline:], "last")):
                    if part:
                        results += list(pool.map(one, part))
                        settled()
                        rss[label] = _rss(proc, url)
            wall = time.perf_counter() - t0
            stop.set()
            watcher.join()
            end = settled()
        finally:
            stop.set()
            _stop(proc)
    return _soak_figures(requests, results, start, end, rss, peaks, max_pending, wall, a.concurrency)


def _soak_figures(requests, results, start, end, rss, peaks, max_pending, wall, concurrency) -> dict:
    count = {kind: sum(1 for r in requests if r["kind"] == kind) for kind in ("valid", "disconnect", "invalid")}
    wrong = {kind: [r["problem"] for r in results if r["kind"] == kind and r["problem"]] for kind in count}
    server_errors = sum(1 for r in results if r["status"] is not None and r["status"] >= 500)
    compiles = end.get("hf_tpu_compiles_total", 0) - start.get("hf_tpu_compiles_total", 0)
    rss_ratio = rss["last"] / rss["first"] if "last" in rss and rss.get("first") else None
    bounded = peaks["in_flight"] <= max_pending and peaks["queue"] <= max_pending * _MAX_N
    empty = all(end.get(name, 0) == 0 for name in ("hf_tpu_queue_depth", "hf_tpu_requests_in_flight",
                                                     "hf_tpu_kv_blocks_in_use"))  # fmt: skip
    queue_ok = bounded and empty
    checks = {
        "valid requests answered": not wrong["valid"],
        "disconnects streamed until they left": not wrong["disconnect"],
        "invalid requests got their 4xx": not wrong["invalid"],
        "no 5xx": server_errors == 0,
        "no compile after warm-up": compiles == 0,
        "queue bounded and empty at the end": queue_ok,
    }  # fmt: skip
    if rss_ratio is not None:
        checks["resident memory flat"] = abs(rss_ratio - 1) <= TARGET_RSS_DRIFT
    examples = {kind: problems[:5] for kind, problems in wrong.items() if problems}
    return {"soak": True, "requests": len(requests), "concurrency": concurrency, "count": count,
            "wrong": {kind: len(p) for kind, p in wrong.items()}, "examples": examples, "server_errors": server_errors,
            "retries_429": sum(r["retries_429"] for r in results), "compiles_after_warmup": compiles,
            "rss_first_bytes": rss.get("first"), "rss_last_bytes": rss.get("last"), "rss_ratio": rss_ratio,
            "peak_queue": peaks["queue"], "peak_in_flight": peaks["in_flight"], "max_pending": max_pending,
            "end_queue": end.get("hf_tpu_queue_depth"), "end_in_flight": end.get("hf_tpu_requests_in_flight"),
            "end_kv_blocks": end.get("hf_tpu_kv_blocks_in_use"), "wall_s": wall,
            "generated_tokens": end.get("hf_tpu_generated_tokens_total", 0) - start.get(
                "hf_tpu_generated_tokens_total", 0),
            "checks": checks, "targets_met": all(checks.values())}  # fmt: skip


def print_soak(f: dict) -> None:
    c, w = f["count"], f["wrong"]
    print(f"hf-tpu serve soak: {f['requests']} requests at concurrency {f['concurrency']} "
          f"({c['valid']} valid, {c['disconnect']} disconnecting mid-stream, {c['invalid']} invalid) in "
          f"{f['wall_s']:.1f} s, {f['generated_tokens']:g} tokens generated")  # fmt: skip

    def line(name, figure):
        print(f"  {name}: {figure}: {'ok' if f['checks'][name] else 'missed'}")

    line("valid requests answered", f"{c['valid'] - w['valid']}/{c['valid']} ({w['valid']} lost)")
    line("disconnects streamed until they left", f"{c['disconnect'] - w['disconnect']}/{c['disconnect']}")
    line("invalid requests got their 4xx", f"{c['invalid'] - w['invalid']}/{c['invalid']}")
    line("no 5xx", f"{f['server_errors']} 5xx")
    line("no compile after warm-up", f"{f['compiles_after_warmup']:g} compiles")
    line("queue bounded and empty at the end",
         f"peak in flight {f['peak_in_flight']:g}/{f['max_pending']} (--max-pending), peak queue "
         f"{f['peak_queue']:g}/{f['max_pending'] * _MAX_N} (--max-pending x most choices); at the end "
         f"{f['end_in_flight']:g} in flight, {f['end_queue']:g} queued, "
         f"{f['end_kv_blocks']:g} KV blocks held")  # fmt: skip
    if "resident memory flat" in f["checks"]:
        last, first = f["rss_last_bytes"] / 2**20, f["rss_first_bytes"] / 2**20
        line("resident memory flat",
             f"{last:.1f} MiB after the last request / {first:.1f} MiB after the first {SOAK_BASELINE} = "
             f"{f['rss_ratio']:.4f} (target within {TARGET_RSS_DRIFT:.0%})")  # fmt: skip
    else:
        print(f"  resident memory: not measured (needs more than {SOAK_BASELINE} requests)")
    if f["retries_429"]:
        print(f"  429 answers retried: {f['retries_429']}")
    for kind, problems in f["examples"].items():
        print(f"  {kind}, first problems: {problems}")
    if _env.BENCH_DEBUG.get():
        print(json.dumps(f, indent=1))
