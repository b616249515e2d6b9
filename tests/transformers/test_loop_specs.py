"""hf_tpu's loops as registered specs (:class:`hf_tpu.transformers._loops.skeleton.LoopSpec`): every loop a route or a
beam call takes is registered with its warm-up, a name is registered once and looked up by name, and a new loop is
one spec in one file plus one registration: the loop this file defines runs ``generate`` and ``hf_tpu.warmup`` end to
end on the simulator, token-identical to upstream's ``generate`` on the CPU."""

from __future__ import annotations

import pytest
import torch

import hf_tpu
import hf_tpu.sim
from hf_tpu.errors import InvalidArgumentError, UnknownNameError
from hf_tpu.transformers import route as routes
from hf_tpu.transformers._loops import cached, skeleton
from hf_tpu.transformers._settings import LOOPS, UPSTREAM, Route, model_state
from hf_tpu.transformers.generation import run_loop

GREEDY = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}


def test_every_loop_a_call_can_take_is_registered_with_its_warm_up():
    names = [name for name in LOOPS if name != UPSTREAM] + [skeleton.BEAM]  # (upstream's loop is upstream's own)
    for name in names:
        spec = skeleton.loop_spec(name)
        assert spec.name == name and callable(spec.run)
        assert callable(spec.warm) or spec.no_warm_up, f"loop {name!r} has neither a warm-up nor a reason for none"
    for spec in skeleton.LOOP_SPECS.values():  # (and every registered one, the route's or not)
        assert (spec.warm is None) != (spec.no_warm_up is None), spec
    # the dispatch reads the registry: a beam call takes beam's loop whatever its route's loop, any other its route's
    assert skeleton.route_spec(Route("cached", beams=True)).name == skeleton.BEAM
    assert skeleton.route_spec(Route("cacheless")).name == "cacheless"


def test_a_name_is_registered_once_and_an_unknown_one_lists_the_known():
    with pytest.raises(InvalidArgumentError, match="'cached' is registered already"):
        skeleton.register_loop(skeleton.LoopSpec("cached", cached.decode_loop, cached.warm_plan))
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        skeleton.register_loop(skeleton.LoopSpec("unwarmed", cached.decode_loop))
    assert "unwarmed" not in skeleton.LOOP_SPECS
    with pytest.raises(UnknownNameError, match=r"no loop is registered as 'nowhere'.*'beam', 'cached', 'cacheless'"):
        skeleton.loop_spec("nowhere")
    with pytest.raises(UnknownNameError, match="'nowhere'"):
        run_loop(None, hf_tpu_plan={"route": Route("nowhere")})


# The test's own loop, one spec: the cached loop's steps, each decode step counted, and its warm-up, counted too.
COUNTED = {"steps": 0, "warmed": 0}


def _counting_steps(call, model, model_kwargs):
    found = cached.cached_steps(call, model, model_kwargs)
    inner = found.step

    def step(next_tokens):
        COUNTED["steps"] += 1
        return inner(next_tokens)

    found.step = step
    return found


def _counting_warm(model, plan, variant):
    COUNTED["warmed"] += 1
    return cached.warm_plan(model, plan, variant)


def _spec(claims=None):
    return skeleton.LoopSpec("counting", skeleton.loop(_counting_steps), _counting_warm, claims=claims)


COUNTING = _spec()


@pytest.fixture
def counting(from_config):
    """A tiny Llama whose route is the test's loop, registered for the test (and unregistered after it): the loop
    claims that model (``LoopSpec.claims``), so route.py's decision takes it with nothing else changed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    cpu, tpu = from_config(LlamaForCausalLM, config)
    skeleton.register_loop(_spec(claims=lambda model: model is tpu))
    assert model_state(tpu).route is None  # (decided at the first call: by the claim)
    COUNTED.update(steps=0, warmed=0)
    try:
        yield cpu, tpu
    finally:
        skeleton.unregister_loop(COUNTING.name)
    assert COUNTING.name not in skeleton.LOOP_SPECS


def test_a_loop_of_one_file_and_one_registration_runs_generate_and_warmup_end_to_end(counting, prompts):
    cpu, tpu = counting
    assert routes.explain(tpu).loop == COUNTING.name
    report = hf_tpu.warmup(tpu, max_prompt_len=16, batch_sizes=[2], max_new_tokens=5, progress=False)
    assert COUNTED["warmed"] == len(report.prompt_buckets) and report.graphs  # warm-up ran the loop's own warm-up
    ids, mask = prompts([3, 11])
    with hf_tpu.sim.stats() as s:
        got = tpu.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY)
    want = cpu.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY)
    assert torch.equal(got.to("cpu"), want)
    assert COUNTED["steps"] >= 4  # the call ran the test's loop: its decode steps went through the counting step
    assert s.compiles == 0  # on the graphs its warm-up compiled


def test_a_claimed_model_whose_loop_fails_its_first_trace_goes_back_to_the_built_in_route(from_config, prompts):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_tpu.transformers._settings import NotCompilableError

    def failing_steps(call, model, model_kwargs):
        error = NotCompilableError("the test's loop cannot trace this model")
        error.reason, error.loop = "the test's loop cannot trace this model", "failing"
        raise error

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    cpu, tpu = from_config(LlamaForCausalLM, config)
    skeleton.register_loop(skeleton.LoopSpec("failing", skeleton.loop(failing_steps), no_warm_up="a test's",
                                             claims=lambda model: model is tpu))  # fmt: skip
    try:
        assert routes.explain(tpu).loop == "failing"
        ids, mask = prompts([3, 11])
        got = tpu.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY)
    finally:
        skeleton.unregister_loop("failing")
    assert torch.equal(got.to("cpu"), cpu.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY))
    route = routes.explain(tpu)
    assert route.loop == "cached" and "'failing', which claimed the model, failed" in route.reason, route
