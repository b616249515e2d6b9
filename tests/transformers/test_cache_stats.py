"""torch_tpu's own cache statistics (``torch.tpu._get_cache_stats()``) as hf_tpu reads them, on the simulator.

The simulated ``torch.tpu`` answers the call from its counters (eager ops and graph compiles are requests, new eager
shape signatures and graph compiles are misses), so the warm-up report, the self-test figures and strict mode read
torch_tpu's statistics through the same code path here as on a chip (:func:`hf_tpu._torch_tpu.cache_stats`).
The attribute names are checked against the wheel's in tests/contract/test_compile_cache_env.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_tpu
import hf_tpu.sim
from hf_tpu import _torch_tpu
from hf_tpu.transformers import generation
from hf_tpu.transformers._loops import skeleton


def test_get_cache_stats_counts_eager_signatures_and_graph_compiles_as_misses():
    stats = torch.tpu._get_cache_stats()
    assert {"num_cache_reqs", "num_cache_hits", "num_compilations", "per_entry_stats"} <= set(dir(stats))
    x = torch.arange(37.0, device="tpu")
    before = _torch_tpu.cache_stats()
    with hf_tpu.sim.stats() as s:
        y = x * 3 - 1  # two signatures this process may not have seen yet
        y = x * 3 - 1  # the same two again: hits
    spent = _torch_tpu.cache_stats() - before
    assert spent.requests == s.ops == 4
    assert spent.misses == s.shape_signatures and spent.hits == 4 - s.shape_signatures >= 2
    assert torch.equal(y.cpu(), torch.arange(37.0) * 3 - 1)

    def f(t):
        return (t.sin() * 2).sum()

    compiled = torch.compile(f, backend="tpu", fullgraph=True)
    with hf_tpu.sim.stats() as eager:
        torch.arange(11.0, device="tpu")
    before = _torch_tpu.cache_stats()
    with hf_tpu.sim.stats() as s:
        out = compiled(torch.arange(11.0, device="tpu"))
        again = compiled(torch.arange(11.0, device="tpu"))
    spent = _torch_tpu.cache_stats() - before
    assert s.compiles == 1 and s.ops > 2  # the graph's own ops ran, but are not lookups of torch_tpu's cache
    assert spent.misses == 1 + s.shape_signatures  # the graph's compile, and the eager arange's first signature
    assert spent.requests == 1 + 2 * eager.ops  # the compile, and the two eager aranges
    torch.testing.assert_close(again.cpu(), out.cpu())
    torch.testing.assert_close(out.cpu(), f(torch.arange(11.0)))


@pytest.fixture
def warmed(pair):
    cpu, tpu = pair("llama")
    generation.configure(tpu, buckets=[16, 32, 64])
    report = hf_tpu.warmup(tpu, max_prompt_len=32, batch_sizes=[2], max_new_tokens=6, progress=False)
    yield cpu, tpu, report
    generation.configure(tpu, strict=False)


def test_warmup_reports_torch_tpu_cache_and_strict_eager_passes_inside_the_ladder(warmed, prompts):
    cpu, tpu, report = warmed
    assert report.tpu_cache_requests is not None and report.tpu_cache_requests >= report.tpu_cache_misses >= 0
    assert "torch_tpu cache:" in str(report)
    generation.configure(tpu, strict=generation.STRICT_EAGER)
    for lengths in ((3, 13), (16, 9), (31, 20)):  # every prompt bucket warm-up covered
        ids, mask = prompts(list(lengths))
        before = _torch_tpu.cache_stats()
        with hf_tpu.sim.stats() as s:
            got = tpu.generate(ids, attention_mask=mask, max_new_tokens=6)
        assert (_torch_tpu.cache_stats() - before).misses == 0
        assert s.compiles == 0 and s.shape_signatures == 0
        assert torch.equal(got, cpu.generate(ids, attention_mask=mask, max_new_tokens=6))


def test_strict_eager_raises_on_an_eager_compile_after_warmup_and_strict_graphs_does_not(warmed, prompts, monkeypatch):
    _, tpu, _ = warmed
    spec = skeleton.loop_spec(generation.explain(tpu).loop)  # the loop the calls below take
    real_loop = spec.run
    calls = []

    def loop_with_a_new_eager_op(*args, **kwargs):
        # an eager op of a signature nothing ran before (a new shape each call): torch_tpu would compile it
        calls.append(1)
        torch.full((3, 5, 1000 + len(calls)), 2.0, device="tpu")
        return real_loop(*args, **kwargs)

    monkeypatch.setitem(skeleton.LOOP_SPECS, spec.name, dataclasses.replace(spec, run=loop_with_a_new_eager_op))
    ids, mask = prompts([4, 9])
    generation.configure(tpu, strict=True)  # graphs only: the eager compile goes through
    tpu.generate(ids, attention_mask=mask, max_new_tokens=6)

    generation.configure(tpu, strict=generation.STRICT_EAGER)
    with hf_tpu.sim.stats() as s:
        with pytest.raises(generation.RecompileError, match=r"torch_tpu's cache missed \d+ of \d+ request") as err:
            tpu.generate(ids, attention_mask=mask, max_new_tokens=6)
    assert s.compiles == 0 and s.shape_signatures >= 1  # no graph compiled: the new eager op was refused
    assert f"cache missed {s.shape_signatures} of" in str(err.value)
    assert len(calls) == 2


def test_strict_eager_from_the_environment_and_bad_values(warmed, monkeypatch):
    _, tpu, _ = warmed
    state = generation.model_state(tpu)
    generation.configure(tpu, strict=None)
    state.settings.strict = None
    monkeypatch.setenv(generation.STRICT_ENV, "eager")
    assert state.strict and state.strict_eager
    monkeypatch.setenv(generation.STRICT_ENV, "1")
    assert state.strict and not state.strict_eager
    with pytest.raises(ValueError, match="strict must be True, False or 'eager'"):
        generation.configure(tpu, strict="graphs")
