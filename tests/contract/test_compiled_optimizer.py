"""hf_tpu.training's compiled AdamW update and gradient clipping through torch-tpu 0.2.0's real front end, no chip.

:mod:`hf_tpu.training.optim` makes the Trainer's optimizer update (``_adamw``: torch's capturable list-op AdamW over
every parameter group) and its clipping (``_clip``) one ``torch.compile(backend="tpu")`` graph each; the simulator
checked them, not the wheel. Here ``hf_tpu.training.AdamW`` and ``clip_grad_norm_`` run on deferred ``tpu``
parameters (three groups: bfloat16 with weight decay, float32 without, float32 with amsgrad; the learning rates 0-d
device tensors, the step counters on the device) in the lowering process (:mod:`hf_tpu.tpu_compile`), the two graphs
lower through torch_tpu's front end and libtpu compiles them for a v5e. The programs' StableHLO then runs on XLA:CPU
from the state of upstream's ``torch.optim.AdamW`` after two CPU steps, and its results equal upstream's third step
(and upstream's ``clip_grad_norm_``).

What the wheel does with the in-place updates: its backend runs AOTAutograd with ``keep_inference_input_mutations=
False`` and passes no donated inputs, so every tensor the update writes (each parameter, both moments, the step
counter; each gradient for the clipping) leaves the program as a new buffer, and AOTAutograd's wrapper copies it back
into the tensor after the program (one eager ``copy_`` per tensor, counted here per warm step). The simulator's
backend keeps those writes inside the graph (``hf_tpu/sim/_backend.py``), which is why it counts none.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_tpu.tpu_compile import lower_and_compile

HERE = Path(__file__).resolve().parent
ENTRY = "_tpu_compile_entries:lower_optimizer"
sys.path.insert(0, str(HERE))
import _tpu_compile_entries as entries  # noqa: E402

ROLES = ("params", "grads", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")
MUTATED = {"params", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"}
BETAS, EPS = (0.9, 0.95), 1e-6  # (the entry's)


@pytest.fixture(scope="module")
def lowered():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        return lower_and_compile(ENTRY, {}, "v5e-1")


def _group_sizes() -> list[int]:
    return [len(shapes) for _, _, _, shapes in entries.OPTIMIZER_GROUPS]


def test_update_and_clip_lower_as_one_graph_each_and_compile_for_a_v5e(lowered):
    assert lowered.error is None, f"{lowered.error}\n at {lowered.where}"
    # three optimizer steps (the first compiles) and two clips: one program each, no recompile, no graph break
    assert [p.name for p in lowered.programs] == ["adamw", "clip"]
    for p in lowered.programs:
        assert p.lowered and p.compiled, f"{p.name}: {p.error}"
        assert p.custom_calls == 0 and p.bytes_accessed > 0 and p.flops > 0
    adamw, clip = lowered.programs
    # every group's tensors are arguments of the one update program: params, grads, two moments, amsgrad's maximum,
    # one step counter per parameter and one learning rate per group
    tensors = sum(_group_sizes())
    amsgrad = sum(len(shapes) for _, _, ams, shapes in entries.OPTIMIZER_GROUPS if ams)
    assert len(adamw.arguments) == 5 * tensors + amsgrad + len(entries.OPTIMIZER_GROUPS), adamw.arguments
    assert len(clip.arguments) == tensors


def test_in_place_updates_leave_the_program_undonated_and_are_copied_back(lowered):
    """torch-tpu 0.2.0 aliases nothing: each tensor the update writes is a new output buffer of the program, and
    AOTAutograd copies it back into the tensor after the program, one eager ``copy_`` per tensor per step (the
    stand-in answers the outputs' allocations; a chip's runtime makes those buffers itself)."""
    adamw, clip = lowered.programs
    tensors = sum(_group_sizes())
    amsgrad = sum(len(shapes) for _, _, ams, shapes in entries.OPTIMIZER_GROUPS if ams)
    written = 4 * tensors + amsgrad  # parameters, both moments, step counters; amsgrad's maximum
    assert adamw.donated == [] and adamw.alias_bytes == 0
    assert clip.donated == [] and clip.alias_bytes == 0
    assert len(adamw.outputs) == written
    assert len(clip.outputs) == tensors + 1  # the scaled gradients and the total norm
    *steps, clipping = lowered.info["warm_eager"]
    assert len(steps) == 2
    for step in steps:  # each warm optimizer step: the graph, then one copy back per written tensor
        assert step["ops"].get("aten.copy_.default") == written, step
        assert step["host_to_device"] == step["device_to_host"] == step["host_reads"] == 0, step
    assert clipping["ops"].get("aten.copy_.default") == tensors, clipping
    # a bfloat16 parameter's new value leaves the program in float32 (the rounding to bfloat16 is the copy back's)
    params_out = [s for s, d in adamw.outputs if d == "float32" and s in
                  [list(shape) for shape in entries.OPTIMIZER_GROUPS[0][3]]]  # fmt: skip
    assert len(params_out) == len(entries.OPTIMIZER_GROUPS[0][3]), adamw.outputs


def _source_key(source: str) -> tuple:
    """``L['groups'][g][role][i]`` -> (g, role name, i); ``L['lrs'][g]`` -> (g, "lr", 0);
    ``L['parameters'][i].grad`` -> (0, "grads", i)."""
    numbers = [int(n) for n in re.findall(r"\[(\d+)\]", source)]
    if source.startswith("L['lrs']"):
        return numbers[0], "lr", 0
    if source.startswith("L['parameters']"):
        return 0, "grads", numbers[0]
    g, role, i = numbers
    return g, ROLES[role], i


def _reference():
    """Upstream's AdamW on the CPU over the entry's groups: the state after two steps (the program's inputs, by
    role) and after a third (what the program must write)."""
    gen = torch.Generator().manual_seed(0)
    groups = []
    for (dtype, wd, amsgrad, shapes), lr in zip(entries.OPTIMIZER_GROUPS, entries.OPTIMIZER_LR):
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(getattr(torch, dtype))) for s in shapes]
        groups.append({"params": params, "weight_decay": wd, "amsgrad": amsgrad, "lr": lr})
    opt = torch.optim.AdamW(groups, betas=BETAS, eps=EPS, foreach=False)
    all_params = [p for g in groups for p in g["params"]]

    def grads():
        for p in all_params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)

    for _ in range(2):
        grads()
        opt.step()
    grads()

    def snapshot():
        out = {}
        for g, group in enumerate(opt.param_groups):
            out[(g, "lr", 0)] = torch.tensor(group["lr"], dtype=torch.float32)
            for i, p in enumerate(group["params"]):
                state = opt.state[p]
                out[(g, "params", i)] = p.detach().clone()
                out[(g, "grads", i)] = p.grad.clone()
                out[(g, "step", i)] = state["step"].clone().float()
                for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    if name in state:
                        out[(g, name, i)] = state[name].clone()
        return out

    before = snapshot()
    opt.step()
    return before, snapshot()


def _by_module_order(program, sources: list[str], order: list[int], values: dict) -> list[torch.Tensor]:
    """The values of ``sources`` (Dynamo's input order) in the module's argument order (``order``: the Dynamo index of
    each argument, as the entry recorded it)."""
    assert sorted(order) == list(range(len(sources))) and len(order) == len(program.arguments)
    args = [values[_source_key(sources[k])] for k in order]
    assert [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in args] == program.arguments
    return args


def test_update_program_equals_upstream_adamw_on_xla_cpu(lowered):
    adamw = lowered.programs[0]
    before, after = _reference()
    sources = lowered.info["sources"][0]
    args = _by_module_order(adamw, sources, lowered.info["module_order"][0], before)
    outs = _run_on_cpu(adamw.text, args, [d for _, d in adamw.arguments])
    written = [s for s in sources if _source_key(s)[1] in MUTATED]  # the outputs: written inputs, in Dynamo's order
    assert len(outs) == len(written) == len(adamw.outputs)
    for source, out in zip(written, outs):
        expected = after[_source_key(source)]
        got = torch.from_numpy(out).to(expected.dtype)  # (a bfloat16 parameter's float32 value, rounded as the copy)
        if expected.dtype == torch.bfloat16:
            # upstream's CPU step rounds each intermediate to bfloat16, the program computes in float32: about one ulp
            # (2**-7 relative; the bfloat16 group's updates are ~0.05, so a missed update fails)
            torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-3, msg=source)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=source)
        assert not torch.equal(expected, before[_source_key(source)]), source  # (the step changed it)


def test_clip_program_equals_upstream_clip_grad_norm_on_xla_cpu(lowered):
    clip = lowered.programs[1]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=gen).to(getattr(torch, dtype)) for dtype, _, _, shapes in
             entries.OPTIMIZER_GROUPS for s in shapes]  # fmt: skip
    sources = lowered.info["sources"][1]
    values = {(0, "grads", i): g for i, g in enumerate(grads)}
    args = _by_module_order(clip, sources, lowered.info["module_order"][1], values)
    outs = _run_on_cpu(clip.text, args, [d for _, d in clip.arguments])
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
    assert norm > 1.0  # (so the gradients are scaled)
    *scaled, total = outs
    torch.testing.assert_close(torch.from_numpy(total), norm.float(), rtol=1e-5, atol=1e-6)
    for p, out in zip(params, scaled):  # (distinct shapes: the outputs follow the gradients)
        got = torch.from_numpy(out).to(p.grad.dtype)
        torch.testing.assert_close(got.float(), p.grad.float(), rtol=1e-2 if p.dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-6)  # fmt: skip


def _run_on_cpu(text: str, tensors: list[torch.Tensor], dtypes: list[str]) -> list[np.ndarray]:
    """hf_tpu.tpu_compile._xla.run_on_cpu in a process of its own (JAX on XLA:CPU, torch_tpu not loaded), each argument
    handed over in float32 and cast there to the module's dtype (numpy has no bfloat16); results in float32."""
    from _timeouts import SAFETY_TIMEOUT_S

    with tempfile.TemporaryDirectory() as tmp:
        np.savez(os.path.join(tmp, "in.npz"), *[t.float().numpy() for t in tensors])
        Path(tmp, "module.mlir").write_text(text)
        code = (
            "import numpy as np, jax.numpy as jnp\n"
            "from hf_tpu.tpu_compile._xla import run_on_cpu\n"
            f"d = np.load({os.path.join(tmp, 'in.npz')!r}); dtypes = {dtypes!r}\n"
            "arrays = [d[f'arr_{i}'].astype(jnp.dtype(t)) for i, t in enumerate(dtypes)]\n"
            f"outs = run_on_cpu(open({os.path.join(tmp, 'module.mlir')!r}).read(), arrays)\n"
            f"np.savez({os.path.join(tmp, 'out.npz')!r}, *[np.asarray(o, dtype=np.float32) for o in outs])\n"
        )
        env = dict(os.environ, JAX_PLATFORMS="cpu", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=SAFETY_TIMEOUT_S)
        d = np.load(os.path.join(tmp, "out.npz"))
        return [d[f"arr_{i}"] for i in range(len(d.files))]
