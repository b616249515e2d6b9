"""Graph-safe RNG on the simulator (hf_tpu/sim/_rng.py), as torch_tpu registers it for its ``tpu`` device.

A compiled training step whose dropout sits under ``torch.utils.checkpoint`` recomputes the dropout in its backward:
the recomputed mask must be the forward's. The wheel's registration itself: tests/contract/test_graphsafe_rng.py.
"""

from __future__ import annotations

import pytest
import torch
from torch._functorch import config as functorch_config
from torch._functorch._aot_autograd import utils as aot_utils
from torch.utils.checkpoint import checkpoint

import hf_tpu
import hf_tpu.sim
from hf_tpu.sim import _rng

P = 0.5


def test_device_generators_have_cudas_graph_safe_state_semantics():
    gen = torch.tpu.default_generators[0]
    assert torch.tpu._get_generator(torch.device("tpu", 0)) is gen
    assert torch.tpu._get_generator(torch.device("tpu")) is gen
    assert gen.device == torch.device("tpu", 0) and isinstance(gen, torch.Generator)
    torch.manual_seed(3)
    home = gen.get_state()
    clone = gen.clone_state()  # an independent copy of the state in force
    assert clone.device == torch.device("tpu", 0) and torch.equal(clone.get_state(), home)
    clone.manual_seed(7)
    assert torch.equal(gen.get_state(), home)  # seeding the copy left the original alone

    saved = gen.graphsafe_get_state()
    gen.graphsafe_set_state(clone)  # the device generator now draws from, and advances, the clone's state
    drawn = torch.rand(5, device="tpu").cpu()
    assert gen.initial_seed() == 7
    gen.graphsafe_set_state(saved)
    cpu = torch.Generator().manual_seed(7)
    assert torch.equal(drawn, torch.rand(5, generator=cpu))  # the clone's seed, drawn as the CPU draws it
    assert torch.equal(clone.get_state(), cpu.get_state())  # ... and the clone advanced
    assert torch.equal(gen.get_state(), home) and gen.initial_seed() == 3  # its own state back, untouched
    torch.manual_seed(3)
    assert torch.equal(torch.rand(5, device="tpu").cpu(), torch.rand(5, generator=torch.Generator().manual_seed(3)))

    user = torch.Generator("tpu").manual_seed(11)  # a user's tpu generator has the same semantics
    copy = user.clone_state()
    drawn = [torch.rand(3, device="tpu", generator=g).cpu() for g in (user, copy)]
    assert torch.equal(*drawn) and torch.equal(drawn[0], torch.rand(3, generator=torch.Generator().manual_seed(11)))
    with pytest.raises(RuntimeError, match="takes a tpu generator"):
        gen.graphsafe_set_state(torch.Generator())


class _Block(torch.nn.Module):
    """Linear, dropout under activation checkpointing, linear: the dropout is recomputed in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        drop = lambda t: torch.nn.functional.dropout(self.up(t), P, training=True)  # noqa: E731
        hidden = checkpoint(drop, x, use_reentrant=False)
        return self.down(hidden).pow(2).mean(), hidden


def _step(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    loss, hidden = model(x)
    loss.backward()
    return loss, hidden


def _run(seed: int, cpu_model: _Block, x: torch.Tensor) -> list[dict]:
    """Two compiled steps (backend="tpu") of a fresh compile on a tpu copy of ``cpu_model``, after
    ``torch.manual_seed(seed)``: each step's loss, gradients and dropout mask, on the host."""
    torch._dynamo.reset()
    model = _Block()
    model.load_state_dict(cpu_model.state_dict())
    model.to("tpu")
    step = torch.compile(_step, backend="tpu")
    torch.manual_seed(seed)
    out = []
    for _ in range(2):
        model.zero_grad()
        loss, hidden = step(model, x.to("tpu"))
        grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
        out.append({"loss": loss.detach().cpu(), "grads": grads, "mask": (hidden != 0).cpu()})
    torch._dynamo.reset()
    return out


@pytest.fixture(scope="module")
def runs():
    hf_tpu.sim.enable()
    cpu_model = _Block()
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    calls = {"n": 0}
    original = _rng.DeviceGenerator.graphsafe_set_state

    def counted(self, state):
        calls["n"] += 1
        return original(self, state)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_rng.DeviceGenerator, "graphsafe_set_state", counted)
        first = _run(0, cpu_model, x)
    return {"cpu_model": cpu_model, "x": x, "first": first, "again": _run(0, cpu_model, x),
            "other": _run(1, cpu_model, x), "graphsafe_calls": calls["n"]}  # fmt: skip


def test_compiled_checkpointed_dropout_recomputes_the_forwards_mask(runs):
    # Each step went through graph-safe RNG: the forward and the recomputed backward each pointed the device
    # generator at their own state and back (2 + 2 calls per step).
    assert runs["graphsafe_calls"] == 8
    for step in runs["first"]:
        mask = step["mask"]
        assert 0.2 < mask.float().mean() < 0.8
        # The same step on the CPU, eagerly, with the mask the compiled forward drew: the gradients agree only if
        # the backward recomputed the same mask.
        model = _Block()
        model.load_state_dict(runs["cpu_model"].state_dict())
        loss = model.down(model.up(runs["x"]) * mask / (1 - P)).pow(2).mean()
        loss.backward()
        torch.testing.assert_close(step["loss"], loss.detach())
        for name, param in model.named_parameters():
            torch.testing.assert_close(step["grads"][name], param.grad, msg=name)
    # Each call draws new numbers: the step's dropout stream advances (it is not frozen into the graph).
    assert not torch.equal(runs["first"][0]["mask"], runs["first"][1]["mask"])


def test_manual_seed_before_a_compiled_step_makes_it_reproducible(runs):
    for first, again in zip(runs["first"], runs["again"]):
        assert torch.equal(first["mask"], again["mask"]) and torch.equal(first["loss"], again["loss"])
        for name, grad in first["grads"].items():
            assert torch.equal(grad, again["grads"][name]), name
    assert not torch.equal(runs["first"][0]["mask"], runs["other"][0]["mask"])


def _rng_state() -> tuple:
    types = aot_utils._GRAPHSAFE_RNG_DEVICE_TYPES
    return (
        sorted(types & {"privateuseone", "tpu"}),
        functorch_config.graphsafe_rng_functionalization,
        functorch_config.functionalize_rng_ops,
    )


def test_disable_restores_torchs_flags_and_device_types():
    assert _rng.installed() and _rng_state() == (["privateuseone", "tpu"], True, False)
    hf_tpu.disable()
    before = _rng_state()
    try:
        assert not _rng.installed() and before[0] == []
        functorch_config.graphsafe_rng_functionalization = False  # a user's settings before the simulator
        functorch_config.functionalize_rng_ops = True
        hf_tpu.sim.enable()
        assert _rng_state() == (["privateuseone", "tpu"], True, False)  # what torch_tpu sets
        hf_tpu.disable()
        assert _rng_state() == ([], False, True)  # the user's settings back
    finally:
        functorch_config.graphsafe_rng_functionalization, functorch_config.functionalize_rng_ops = before[1:]
        hf_tpu.sim.enable()
    assert _rng.installed()


_DRAW = """
import json, sys, torch
import hf_tpu.sim
hf_tpu.sim.enable()
if sys.argv[1] != "unseeded":
    torch.manual_seed(int(sys.argv[1]))
logits = torch.zeros(1, 1000, device="tpu")
draws = torch.multinomial(torch.softmax(logits, -1), 8, replacement=True).cpu().tolist()
cpu = torch.multinomial(torch.softmax(logits.cpu(), -1), 8, replacement=True).tolist()
print(json.dumps({"seed": torch.tpu.default_generators[0].initial_seed(), "tpu": draws, "cpu": cpu}))
"""


def _fresh_process_draws(arg: str) -> dict:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from _timeouts import SAFETY_TIMEOUT_S

    env = {**os.environ, "HF_TPU_SIMULATE": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _DRAW, arg], env=env, capture_output=True, text=True,
                          timeout=SAFETY_TIMEOUT_S, check=True)  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_default_generator_is_seeded_per_process_as_torch_tpu_and_the_cpu_are():
    """issue 36: unseeded sampling on the simulated device drew the same tokens in every fresh process (a new
    torch.Generator's fixed seed); torch-tpu 0.2.0 seeds each device's default generator from the host's entropy once
    per process, as torch does the CPU's. Fresh processes now differ, as on CPU; torch.manual_seed makes them repeat."""
    first, second = _fresh_process_draws("unseeded"), _fresh_process_draws("unseeded")
    assert first["cpu"] != second["cpu"]  # the reference: CPU sampling differs between fresh processes
    assert first["seed"] != second["seed"] and first["tpu"] != second["tpu"]
    assert 67280421310721 not in (first["seed"], second["seed"])
    seeded = _fresh_process_draws("5")
    torch.manual_seed(5)  # this process: the same seed, the same draws
    logits = torch.zeros(1, 1000, device="tpu")
    here = torch.multinomial(torch.softmax(logits, -1), 8, replacement=True).cpu().tolist()
    assert seeded["seed"] == 5 and seeded["tpu"] == here
