"""Graph kinds and kernel forms as registered specs (hf_tpu.transformers._graph_key, hf_tpu.kernels.forms): a
kind and a form registered by a test run end to end through run_graph on the simulator, like the CPU; every kind is
described and every kind hf_tpu builds is registered."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hf_tpu.errors import InvalidArgumentError
from hf_tpu.kernels.forms import KernelForm, choose_form, register_kernel_form, unregister_kernel_form
from hf_tpu.transformers import _graphs
from hf_tpu.transformers._graph_key import GraphKind
from hf_tpu.transformers._graph_key import GraphKey, GraphSpec, graph_spec, graph_specs, register_graph
from hf_tpu.transformers._graph_key import unregister_graph
from hf_tpu.transformers._settings import ModelState

PACKAGE = Path(_graphs.__file__).resolve().parents[1]


def _last_position(model, ids):
    """A test's graph body: the last position's logits, reduced over the vocabulary by the test's kernel form."""
    logits = model(input_ids=ids, return_dict=True).logits[:, -1, :].float()
    if choose_form("test_reduce", tokens=ids.shape[1]) == "max":
        return logits.amax(dim=-1)
    return logits.logsumexp(dim=-1)


@pytest.fixture
def test_kind():
    """A graph kind and a kernel form of the test's own, registered for the test only."""
    form = KernelForm(
        "test_reduce", ("max", "logsumexp"), "the test graph's reduction", unmeasured="a test's form",
        pick=lambda override, tokens: "max" if tokens <= 8 else "logsumexp",
    )  # fmt: skip
    spec = GraphSpec("test_last_position", _last_position, ("prompt length",), "a test's graph")
    register_kernel_form(form)
    register_graph(spec)
    try:
        yield spec
    finally:
        assert unregister_graph(spec.base) is spec
        assert unregister_kernel_form(form.name) is form


@pytest.mark.parametrize("length", [6, 12])  # the form's two choices
def test_a_kind_registered_in_a_test_runs_through_run_graph_like_the_cpu(llama, test_kind, length):
    cpu, tpu = llama
    ids = torch.randint(0, cpu.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        expected = _last_position(cpu, ids)
        state = ModelState()
        key = (GraphKind(test_kind.base), 2, length)
        got = _graphs.run_graph(tpu, state, key, ids.to("tpu"))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)
    (compiled,) = state.compile_log
    assert isinstance(compiled, GraphKey) and compiled == key and hash(compiled) == hash(key)
    assert (compiled.kind, compiled.batch, compiled.dim("prompt length")) == (GraphKind(test_kind.base), 2, length)
    assert repr(compiled) == repr(key)  # (the compile cache and the reports show keys as before)
    assert _graphs._describe(compiled) == f"test_last_position graph for batch=2, prompt length={length}"


def test_a_kind_registered_twice_is_refused_by_name(test_kind):
    with pytest.raises(InvalidArgumentError, match="test_last_position"):
        register_graph(GraphSpec(test_kind.base, _last_position, (), "again"))
    with pytest.raises(InvalidArgumentError, match="test_reduce"):
        register_kernel_form(KernelForm("test_reduce", ("max",), "again", unmeasured="a test's", pick=max))
    with pytest.raises(InvalidArgumentError, match="no graph kind 'test_unknown'"):
        graph_spec("test_unknown")


def test_every_kind_is_described_by_its_dims():
    for spec in graph_specs():
        key = GraphKey(GraphKind(spec.base), 3, *(10 + i for i in range(len(spec.fields))))
        text = spec.describe(key)
        assert text.startswith(f"{spec.base} graph for batch=3"), text
        for i, field in enumerate(spec.fields):
            assert f"{field}={10 + i}" in text and key.dim(field) == 10 + i, (spec.base, field)
        assert spec.doc.strip(), spec.base


def test_every_kind_hf_tpu_builds_is_registered():
    built = set()
    for path in PACKAGE.rglob("*.py"):
        code = "\n".join(line for line in path.read_text().splitlines() if ">>>" not in line)  # (not the examples)
        built |= set(re.findall(r'GraphKind\(\s*"(\w+)"', code))
    registered = {spec.base for spec in graph_specs()}
    assert built and built <= registered, sorted(built - registered)
