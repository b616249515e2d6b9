"""The continuous-batching step graph through torch-tpu 0.2.0's real front end, compiled for a v5e, no chip.

A ``tpu`` manager's step (hf_tpu/serving: the inputs staged in one flat int32 tensor whose views the graph takes, the
attention mask made in the graph from the cumulative lengths, the int32 cache indices made int64 there, a one-value
flag choosing the previous step's tokens as input ids, per-row sampling) was checked on the simulator only. Here
upstream's own warm-up (``ModelRunner.run_one_warmup``) runs a tiny Llama's manager on deferred ``tpu`` weights and
cache in the lowering process (``_tpu_compile_entries.lower_serving_step``) for a first prefill (32 query tokens, no
cache read) and a step that reads 64 cached tokens (the shape of decodes and chunked prefills), twice each.

Not compared on XLA:CPU: with SDPA each layer's attention is torch_tpu's Mosaic flash kernel (a custom call XLA:CPU
cannot run), and the module's arguments do not map back to the step's inputs by Dynamo's order (the written cache
views become one synthetic base, and the front end orders arguments by first use); the mask's values are checked
against upstream's ``build_attention_mask`` in tests/serving/test_step_ops.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hf_tpu.tpu_compile import lower_and_compile

HERE = Path(__file__).resolve().parent
SHAPES = ((32, 0), (32, 64))


@pytest.fixture(scope="module")
def lowered():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        return lower_and_compile("_tpu_compile_entries:lower_serving_step", {"shapes": SHAPES}, "v5e-1")


def test_each_step_shape_lowers_as_one_program_and_compiles_for_a_v5e(lowered):
    assert lowered.error is None, f"{lowered.error}\n at {lowered.where}"
    assert lowered.info["staged"] is True  # (hf_tpu's staging was installed: the path under test)
    # one program per shape, each lowered once (the second, warm step of a shape reuses it): no graph break in the
    # in-graph mask, index conversion, flag or cache update, and no recompile
    assert [p.name for p in lowered.programs] == [f"step-{q}x{kv}" for q, kv in SHAPES]
    for p in lowered.programs:
        assert p.lowered and p.compiled, f"{p.name}: {p.error}"
        assert p.bytes_accessed > 0 and p.flops > 0
        assert p.custom_calls == 2  # (SDPA's flash kernel, one per layer of the tiny Llama)


def test_the_step_takes_int32_views_and_makes_its_mask_inside(lowered):
    flat = lowered.info["flat"][0]
    for p, (q, kv) in zip(lowered.programs, SHAPES):
        keys = kv + q  # (a step that reads the cache reads its own new tokens too)
        # no mask argument: the [1, 1, q, k] mask exists only inside the program
        assert not any(len(shape) == 4 for shape, _ in p.arguments), p.arguments
        # the staged inputs arrive as int32 (the flat tensor's views), nothing of them as int64; the one-value flag
        # is an argument of its own
        assert not any(d == "int64" for _, d in p.arguments), p.arguments
        assert [[1], "int32"] in p.arguments
        assert [[q], "int32"] in p.arguments and (kv == 0 or [[keys], "int32"] in p.arguments)  # write, read index
        assert not any(shape == [flat] for shape, _ in p.arguments)  # (views, not the flat tensor itself)


def test_the_step_returns_only_what_it_writes(lowered):
    """The program's results are the tensors the step writes: the paged cache (its per-layer views' base), the output
    rows and the penalty table's counts. Values the step put into the caller's ``batch_data`` dict came out as extra
    results (the mask, the input ids, both int64 indices: a side effect Dynamo replays after the graph) until
    ``_sampling.step`` worked on a copy of the dict."""
    for p in lowered.programs:
        assert len(p.outputs) == 3, p.outputs
        assert not any(len(shape) == 4 or d == "int64" for shape, d in p.outputs), p.outputs
        # torch-tpu 0.2.0 donates nothing (tests/contract/test_compiled_optimizer.py): the written cache leaves the
        # program as a new buffer each step
        assert p.donated == []


def test_a_warm_step_sends_its_inputs_in_one_copy(lowered):
    warm = lowered.info["warm_eager"]
    assert len(warm) == len(SHAPES)
    for counts in warm:  # (the warm-up reads nothing back)
        assert counts["host_to_device"] == 1 and counts["device_to_host"] == 0 and counts["host_reads"] == 0, counts
