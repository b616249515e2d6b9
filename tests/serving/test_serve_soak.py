"""The short form of ``hf-tpu bench serve --soak``: 60 mixed requests at concurrency 8 against ``hf-tpu serve
--simulate`` (the smallest ladder), with the benchmark's checks except resident memory (that needs the long run's
more than 200 requests; docs/serving.md has its figures)."""

from __future__ import annotations

import json

from hf_tpu.benchmarks import serve
from hf_tpu.benchmarks.__main__ import benchmark_parser


def test_the_mix_has_every_kind_of_request():
    requests = serve.soak_requests(2000)
    kinds = {r["kind"] for r in requests}
    assert kinds == {"valid", "disconnect", "invalid"}
    bodies = [r["body"] for r in requests if r["kind"] == "valid"]
    assert any("messages" in b for b in bodies) and any("prompt" in b for b in bodies)
    assert any(b["stream"] for b in bodies) and not all(b["stream"] for b in bodies)
    assert any(b.get("temperature") == 0 for b in bodies) and any("seed" in b for b in bodies)
    for field in ("n", "stop", "logprobs", "top_p", "top_k", "ignore_eos"):
        assert any(field in b for b in bodies), field
    assert serve.soak_requests(60) == serve.soak_requests(60)  # seeded: the same mix every run


def test_a_short_soak_loses_nothing_compiles_nothing_and_keeps_the_queue_bounded(capsys):
    args = benchmark_parser("serve").parse_args(
        ["--soak", "--requests", "60", "--concurrency", "8", "--slots", "4", "--max-batch-tokens", "32"]
    )
    f = serve.run(args)
    serve.print_table(f)
    out = capsys.readouterr().out
    assert f["count"]["valid"] > 40 and f["count"]["disconnect"] > 0 and f["count"]["invalid"] > 0, f["count"]
    assert f["wrong"] == {"valid": 0, "disconnect": 0, "invalid": 0}, f["examples"]
    assert f["server_errors"] == 0
    assert f["compiles_after_warmup"] == 0
    assert f["peak_in_flight"] <= f["max_pending"]
    assert f["end_queue"] == 0 and f["end_in_flight"] == 0 and f["end_kv_blocks"] == 0
    assert f["targets_met"], out
    assert "missed" not in out and "resident memory: not measured" in out


def test_a_wrong_answer_is_seen():
    """The soak's answer check (no server): a missing choice, a bad finish_reason, a 5xx, missing logprobs."""
    chat = {"kind": "valid", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                      "stream": False, "n": 2}}  # fmt: skip
    good = {"choices": [{"index": i, "message": {"content": "a"}, "finish_reason": "stop"} for i in range(2)]}
    assert serve._answer_problem(chat, 200, json.dumps(good).encode()) is None
    one = {"choices": good["choices"][:1]}
    assert "finish_reason" in serve._answer_problem(chat, 200, json.dumps(one).encode())
    odd = {"choices": [dict(c, finish_reason="error") for c in good["choices"]]}
    assert "finish_reason" in serve._answer_problem(chat, 200, json.dumps(odd).encode())
    assert serve._answer_problem(chat, 500, b"") == "status 500"
    streamed = {"kind": "valid", "body": {"prompt": "x", "max_tokens": 1, "stream": True, "logprobs": 2}}
    chunks = [{"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
              {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}]  # fmt: skip
    problem = serve._answer_problem(streamed, 200, chunks)
    assert "max_tokens" in problem
    streamed["body"]["max_tokens"] = 2
    assert "logprobs" in serve._answer_problem(streamed, 200, chunks)
