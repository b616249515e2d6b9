"""hf_tpu's experts forms (hf_tpu.kernels.experts_forms): the torch forms against a float64 loop, and the choice
between the forms from the measured table."""

from __future__ import annotations

import pytest
import torch

from hf_tpu.errors import InvalidArgumentError
from hf_tpu.kernels import experts_forms
from ragged_helpers import experts_reference, make_experts, routing


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("forward", [experts_forms.dense_experts_forward, experts_forms.slots_experts_forward])
def test_torch_forms_match_float64(forward, tokens):
    g = torch.Generator().manual_seed(tokens)
    module = make_experts(8)
    hidden = torch.randn(tokens, 32, generator=g)
    index, weights = routing("random", tokens, 8, 2, g)
    want = experts_reference(module, hidden, index, weights)
    torch.testing.assert_close(forward(module, hidden, index, weights).double(), want, rtol=1e-5, atol=1e-5)
    # expert parallelism's sentinel (an id >= E): that slot contributes nothing
    index[0, 0] = 8
    kept = weights.clone()
    kept[0, 0] = 0
    want = experts_reference(module, hidden, index.clamp(max=7), kept)
    torch.testing.assert_close(forward(module, hidden, index, weights).double(), want, rtol=1e-5, atol=1e-5)


def test_slots_form_past_its_limit_runs_grouped_mm():
    """More (token, slot) pairs than MAX_SLOTS: the layer runs transformers' grouped_mm (the same result)."""
    g = torch.Generator().manual_seed(0)
    module = make_experts(8)
    tokens = experts_forms.MAX_SLOTS // 2 + 1
    hidden = torch.randn(tokens, 32, generator=g)
    index, weights = routing("random", tokens, 8, 2, g)
    want = experts_reference(module, hidden, index, weights)
    torch.testing.assert_close(experts_forms.slots_experts_forward(module, hidden, index, weights).double(), want,
                               rtol=1e-4, atol=1e-4)  # fmt: skip


TABLE = {"rows": [
    {"model": "a", "hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8, "tokens": 1,
     "seconds": {"slots": 1.0, "dense": 3.0, "kernel_decode": 0.97, "grouped_mm": 6.0}},
    {"model": "a", "hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8, "tokens": 8,
     "seconds": {"slots": 1.0, "dense": 2.0}},
    {"model": "a", "hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8, "tokens": 64,
     "seconds": {"dense": 2.0, "grouped_mm": 5.0, "kernel": 2.5}},
    {"model": "a", "hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8, "tokens": 2048,
     "seconds": {"dense": 9.0, "grouped_mm": 5.0, "kernel": 4.0}},
    {"model": "b", "hidden": 4096, "intermediate": 14336, "experts": 8, "top_k": 2, "tokens": 1,
     "seconds": {"slots": 2.0, "dense": 1.5, "grouped_mm": 6.0}},
]}  # fmt: skip


def test_choose_takes_the_nearest_measurement_and_its_fastest_form():
    choose = experts_forms.choose
    # the nearest token count (log scale), its fastest form; ties within MARGIN go to the torch forms
    assert choose(2048, 768, 128, 8, 1, table=TABLE) == "slots"  # kernel_decode is 3% faster: within the margin
    assert choose(2048, 768, 128, 8, 48, table=TABLE) == "dense"
    assert choose(2048, 768, 128, 8, 4096, table=TABLE) == "kernel"
    assert choose(2048, 768, 128, 8, 4096, forms=experts_forms.DEFAULT_FORMS, table=TABLE) == "grouped_mm"
    # the nearest shape: a Mixtral-like layer takes row b
    assert choose(4096, 14336, 8, 2, 1, table=TABLE) == "dense"
    # the slots form never past MAX_SLOTS pairs, even where the nearest row measured it
    assert choose(2048, 768, 128, 8, 8, table=TABLE) == "slots"
    assert choose(2048, 768, 128, 8, 9, table=TABLE) == "dense"  # 72 pairs
    with pytest.raises(ValueError, match="no measured experts form"):
        choose(2048, 768, 128, 8, 1, forms=("batched_mm",), table=TABLE)


def test_shipped_table_answers_a_form_for_every_bucket():
    """The table committed with hf_tpu (chip measurements): every token count of the three measured shapes gets a
    form hf_tpu can run without the kernel, and the decode sizes of a Qwen3-30B-A3B layer read only routed experts."""
    table = experts_forms.measured_table()
    assert {r["model"] for r in table["rows"]} >= {"Qwen3-30B-A3B", "Mixtral-8x7B", "gpt-oss-20b"}
    for tokens in (1, 8, 64, 512, 2048):
        for shape in ((2048, 768, 128, 8), (4096, 14336, 8, 2), (2880, 2880, 32, 4)):
            form = experts_forms.choose(*shape, tokens, forms=experts_forms.DEFAULT_FORMS)
            assert form in experts_forms.DEFAULT_FORMS
    assert experts_forms.choose(2048, 768, 128, 8, 1, forms=experts_forms.DEFAULT_FORMS) == "slots"


def test_measured_implementation_on_a_model_equals_eager():
    """A tiny Qwen3-MoE with experts_implementation="hf_tpu_measured" (the CPU here): the same logits as eager."""
    from hf_tpu.testing import tiny_config
    from transformers import AutoModelForCausalLM

    name = experts_forms.use_measured_experts()
    config = tiny_config("qwen3_moe", vocab_size=128)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config, experts_implementation="eager").eval()
    measured = AutoModelForCausalLM.from_config(config, experts_implementation=name).eval()
    measured.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(measured(ids).logits, eager(ids).logits, rtol=1e-4, atol=1e-4)  # prefill
        torch.testing.assert_close(measured(ids[:, :1]).logits, eager(ids[:, :1]).logits, rtol=1e-4, atol=1e-4)


def test_prefer_measured_only_on_torch_tpu_and_not_when_kept(monkeypatch):
    """Off a tpu device, or with the model's implementation kept, nothing changes; the simulator keeps transformers'
    default too (the table was measured for torch_tpu's device)."""
    from hf_tpu.testing import tiny_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", vocab_size=128))
    assert model.config._experts_implementation == "grouped_mm"
    assert experts_forms.prefer_measured(model) is False  # on the CPU
    model.__dict__[experts_forms.KEEP] = True
    assert experts_forms.prefer_measured(model) is False
    assert model.config._experts_implementation == "grouped_mm"


def test_measured_name_takes_the_kernel_forms_only_on_a_tpu_vm(monkeypatch):
    """On TPU chips (runtime mode "real") with jax and kernels importable, every form, the kernel's included (they
    ran inside torch_tpu's compiled graphs on a v5e); without a chip (the lowering of hf-tpu plan, the CPU, the
    simulator) the torch forms; HF_TPU_MEASURED_EXPERTS=torch asks for the torch forms, a wrong value is refused."""
    import importlib.util
    from types import SimpleNamespace

    from hf_tpu import runtime

    monkeypatch.delenv(experts_forms.MEASURED_ENV, raising=False)
    assert runtime.detect().mode != "real"
    assert experts_forms.measured_name() == experts_forms.MEASURED_NAME  # this host: no chip
    monkeypatch.setattr(runtime, "detect", lambda: SimpleNamespace(mode="real"))
    real_find = importlib.util.find_spec
    present = {"jax": object(), "kernels": object()}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: present.get(name) or real_find(name, *a))
    assert experts_forms.measured_name() == experts_forms.MEASURED_KERNELS_NAME
    monkeypatch.setenv(experts_forms.MEASURED_ENV, "torch")
    assert experts_forms.measured_name() == experts_forms.MEASURED_NAME
    monkeypatch.setenv(experts_forms.MEASURED_ENV, "kernel")
    with pytest.raises(InvalidArgumentError, match="HF_TPU_MEASURED_EXPERTS='kernel'"):
        experts_forms.measured_name()
    monkeypatch.delenv(experts_forms.MEASURED_ENV)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kernels" else present["jax"])
    assert experts_forms.measured_name() == experts_forms.MEASURED_NAME  # the kernel's loader is missing


def test_measured_choice_compiles_into_one_graph():
    """The choice is a constant of the traced graph (shapes are static there): ``torch.compile(fullgraph=True)``
    takes the model whole, as hf_tpu compiles its buckets, and computes what eager computes."""
    from hf_tpu.testing import tiny_config
    from transformers import AutoModelForCausalLM

    name = experts_forms.use_measured_experts()
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", vocab_size=128), experts_implementation=name)
    model.eval()
    ids = torch.randint(0, 128, (2, 1))
    compiled = torch.compile(lambda x: model(x).logits, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), model(ids).logits)


def test_kernel_forms_are_loaded_before_the_trace(monkeypatch):
    """``"hf_tpu_measured_kernels"`` loads the Hub kernel when it is registered, outside any trace: loading it reads
    files (``os.stat``), which Dynamo cannot trace, and on a v5e that graph break sent ``generate`` to upstream's eager
    loop. A compiled graph that picks a kernel form then traces whole, and loads nothing more."""
    from hf_tpu.kernels import loader

    loads = []
    real_load = loader.load_ragged_dot_kernel
    monkeypatch.setattr(loader, "load_ragged_dot_kernel", lambda: loads.append(1) or real_load())
    monkeypatch.setattr(experts_forms, "_KERNEL_FORWARDS", {})
    assert experts_forms.use_measured_experts(experts_forms.MEASURED_KERNELS_NAME) == "hf_tpu_measured_kernels"
    assert loads == [1] and set(experts_forms._KERNEL_FORWARDS) == set(experts_forms.KERNEL_FORMS)

    def pick(x):
        forward = experts_forms._form_forward("kernel_decode")
        return x * 2 if forward is experts_forms._KERNEL_FORWARDS["kernel_decode"] else x

    torch._dynamo.reset()
    assert torch.compile(pick, backend="eager", fullgraph=True)(torch.ones(2)).tolist() == [2.0, 2.0]
    assert loads == [1]
    with pytest.raises(InvalidArgumentError, match="not a measured experts implementation"):
        experts_forms.use_measured_experts("hf_tpu_dense")
