"""hf_tpu.training's compiled AdamW update and gradient clipping through torch-tpu 0.2.0's real front end, no chip.

:mod:`hf_tpu.training.optim` compiles the Trainer's optimizer update as one graph per bucket of parameters (one
parameter group, one shape and dtype: ``_adamw``, torch's capturable list-op AdamW on clones, returning the new
values) and its clipping as a norm graph that only reads the gradients (``_norm``) and one graph per bucket that
returns them scaled (``_scale``); the optimizer rebinds the results (``param.data``, the state's entries, ``.grad``).
Here ``hf_tpu.training.AdamW`` and ``clip_grad_norm_`` run on deferred ``tpu`` parameters (three groups: bfloat16
with weight decay, float32 without, float32 with amsgrad; the learning rates 0-d device tensors, the step counters on
the device) in the lowering process (:mod:`hf_tpu.tpu_compile`), the graphs lower through torch_tpu's front end and
libtpu compiles them for a v5e. The programs' StableHLO then runs on XLA:CPU from the state of upstream's
``torch.optim.AdamW`` after two CPU steps, and its results equal upstream's third step (and upstream's
``clip_grad_norm_``).

Why the graphs return their results instead of writing their inputs: the wheel's backend runs AOTAutograd with
``keep_inference_input_mutations=False`` and donates no input, so a tensor a graph writes leaves the program as a new
buffer and AOTAutograd copies it back with one eager ``copy_`` per tensor; one program writing every tensor also held
the inputs and outputs of all of them at once (libtpu refused the 16-layer Llama-3.2-1B update for a v5e's HBM).
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

from hf_tpu.tpu_compile import lower_and_compile, target

HERE = Path(__file__).resolve().parent
ENTRY = "_tpu_compile_entries:lower_optimizer"
sys.path.insert(0, str(HERE))
import _tpu_compile_entries as entries  # noqa: E402

#: The graphs' argument names (Dynamo's ``L['name']``) -> the reference's role names.
ROLES = {"params": "params", "grads": "grads", "exp_avgs": "exp_avg", "exp_avg_sqs": "exp_avg_sq",
         "max_exp_avg_sqs": "max_exp_avg_sq", "steps": "step", "lr": "lr", "factor": "factor"}  # fmt: skip
#: What an update graph returns, in order, a list each.
RETURNED = ("params", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")
BETAS, EPS = (0.9, 0.95), 1e-6  # (the entry's)


@pytest.fixture(scope="module")
def lowered():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        return lower_and_compile(ENTRY, {}, "v5e-1")


def _buckets(groups) -> list[tuple[int, tuple, int]]:
    """The update's graphs for ``groups`` (the entry's form): (group, shape, length) of each distinct bucket, as
    ``hf_tpu.training.optim._buckets`` cuts them (on meta tensors)."""
    from hf_tpu.training import optim

    found = []
    for g, (dtype, _, amsgrad, shapes) in enumerate(groups):
        tensors = [torch.empty(s, dtype=getattr(torch, dtype), device="meta") for s in shapes]
        for bucket in optim._buckets(tensors, 4 if amsgrad else 3):
            key = (g, tuple(shapes[bucket[0]]), len(bucket))
            found += [key] if key not in found else []
    return found


def _programs(lowered, name: str) -> list[tuple[int, object]]:
    return [(k, p) for k, p in enumerate(lowered.programs) if p.name == name]


def test_one_graph_per_bucket_each_compiled_once_for_a_v5e(lowered):
    assert lowered.error is None, f"{lowered.error}\n at {lowered.where}"
    # the forward, three optimizer steps (the first compiles), two clips: each graph compiles once; the forward of a
    # module holding the parameters does not recompile after the steps rebind their ``.data``
    graphs = _buckets(entries.OPTIMIZER_GROUPS)
    shapes = {tuple(s) for _, _, _, group in entries.OPTIMIZER_GROUPS for s in group}
    assert len(graphs) == len(shapes) == 6 and (0, (24, 16), 2) in graphs  # (two (24, 16) tensors: one bucket)
    assert [p.name for p in lowered.programs] == ["forward"] + ["adamw"] * len(graphs) + ["norm"] + \
        ["scale"] * len(shapes)  # fmt: skip
    for p in lowered.programs:
        assert p.lowered and p.compiled, f"{p.name}: {p.error}"
        assert p.custom_calls == 0 and p.bytes_accessed > 0
    assert len(lowered.info["sources"]) == len(lowered.programs)
    for (k, p), (g, shape, length) in zip(_programs(lowered, "adamw"), graphs):
        amsgrad = entries.OPTIMIZER_GROUPS[g][2]
        assert len(p.arguments) == (6 if amsgrad else 5) * length + 1  # (the tensors' lists, the learning rate)
        assert [[g, i] for g, i in lowered.info["calls"][k]] and {c[0] for c in lowered.info["calls"][k]} == {g}
        assert {tuple(s) for s, _ in p.outputs[:length]} == {shape}
    (_, norm), = _programs(lowered, "norm")
    assert len(norm.arguments) == lowered.info["tensors"] and len(norm.outputs) == 2  # (the norm, the factor)


def test_the_graphs_return_their_results_in_the_tensors_dtypes_and_nothing_is_copied_back(lowered):
    """No program writes an input: nothing is donated or aliased, and no warm step or clip runs an eager ``copy_``
    (or any device op but the stand-in's answer to each program output's allocation, ``aten.empty``; a chip's
    runtime makes those buffers itself). Each bucket's new parameters and moments leave in the parameters' dtype
    (bfloat16 ones too: the graph casts them back), the step counters in float32; the optimizer keeps them so."""
    for p in lowered.programs:
        assert p.donated == [] and p.alias_bytes == 0, p.name
    adamw, scale = _programs(lowered, "adamw"), _programs(lowered, "scale")
    outputs = {"adamw": sum(len(p.outputs) for _, p in adamw), "clip": sum(len(p.outputs) for _, p in scale) + 2}
    *steps, clipping = lowered.info["warm_eager"]
    assert len(steps) == 2
    for warm, kind in [(s, "adamw") for s in steps] + [(clipping, "clip")]:
        device_ops = {op: n for op, n in warm["ops"].items() if not op.startswith("profiler.")}
        assert device_ops == {"aten.empty.memory_format": outputs[kind]}, warm
        assert warm["eager_ops"] == outputs[kind], warm
        assert warm["host_to_device"] == warm["device_to_host"] == warm["host_reads"] == 0, warm
    for k, p in adamw:
        (g, _), *_ = lowered.info["calls"][k]
        dtype, _, amsgrad, _ = entries.OPTIMIZER_GROUPS[g]
        length = len(lowered.info["calls"][k])
        moments = 3 if amsgrad else 2
        assert [d for _, d in p.outputs] == [dtype] * (1 + moments) * length + ["float32"] * length, p.outputs
    dtypes = [dtype for dtype, _, _, shapes in entries.OPTIMIZER_GROUPS for _ in shapes]
    for k, p in scale:  # (the gradients' own dtypes)
        assert [d for _, d in p.outputs] == [dtypes[i] for _, i in lowered.info["calls"][k]], p.outputs
    assert lowered.info["dtypes"] == {"param": "torch.bfloat16", "step": "torch.float32",
                                      "exp_avg": "torch.bfloat16", "exp_avg_sq": "torch.bfloat16"}  # fmt: skip


def _source_key(source: str, call: list) -> tuple:
    """Dynamo's ``L['exp_avgs'][j]`` of a graph whose call had the bucket ``call`` (``[group, index]`` per entry)
    -> (group, "exp_avg", index); ``L['lr']`` -> (group, "lr", 0); ``L['factor']`` -> (0, "factor", 0)."""
    name = re.match(r"L\['(\w+)'\]", source).group(1)
    if name in ("lr", "factor"):
        return call[0][0], ROLES[name], 0
    g, i = call[int(re.findall(r"\[(\d+)\]", source)[0])]
    return g, ROLES[name], i


def _reference():
    """Upstream's AdamW on the CPU over the entry's groups: the state after two steps (the programs' inputs, by
    role) and after a third (what the programs must return)."""
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


def _arguments(lowered, k: int, values: dict) -> list[torch.Tensor]:
    """The values of program ``k``'s inputs in its module's argument order (torch_tpu's front end orders them by first
    use: ``module_order`` holds the Dynamo index of each argument, as the entry recorded it)."""
    program, sources, order = lowered.programs[k], lowered.info["sources"][k], lowered.info["module_order"][k]
    assert sorted(order) == list(range(len(sources))) and len(order) == len(program.arguments)
    args = [values[_source_key(sources[i], lowered.info["calls"][k])] for i in order]
    assert [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in args] == program.arguments
    return args


def _assert_close(got: np.ndarray, expected: torch.Tensor, what) -> None:
    got = torch.from_numpy(got).to(expected.dtype)
    if expected.dtype == torch.bfloat16:
        # upstream's CPU step rounds each intermediate to bfloat16, the program computes in float32: about one ulp
        # (2**-7 relative; the bfloat16 group's updates are ~0.05, so a missed update fails)
        torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-3, msg=str(what))
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=str(what))


def test_update_programs_equal_upstream_adamw_on_xla_cpu(lowered):
    before, after = _reference()
    programs = _programs(lowered, "adamw")
    results = _run_on_cpu([(p.text, _arguments(lowered, k, before), [d for _, d in p.arguments]) for k, p in programs])
    checked = set()
    for (k, program), outs in zip(programs, results):
        call = lowered.info["calls"][k]
        g = call[0][0]
        returned = [r for r in RETURNED if r != "max_exp_avg_sq" or entries.OPTIMIZER_GROUPS[g][2]]
        assert len(outs) == len(returned) * len(call) == len(program.outputs)
        for n, out in enumerate(outs):
            key = (g, returned[n // len(call)], call[n % len(call)][1])
            _assert_close(out, after[key], key)
            assert not torch.equal(after[key], before[key]), key  # (the step changed it)
            checked.add(key)
    assert len(checked) == sum(len(shapes) * (5 if ams else 4) for _, _, ams, shapes in entries.OPTIMIZER_GROUPS)


def test_clip_programs_equal_upstream_clip_grad_norm_on_xla_cpu(lowered):
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=gen).to(getattr(torch, dtype)) for dtype, _, _, shapes in
             entries.OPTIMIZER_GROUPS for s in shapes]  # fmt: skip
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
    assert norm > 1.0  # (so the gradients are scaled)
    factor = torch.clamp(1.0 / (norm.float() + 1e-6), max=1.0)  # (upstream's factor; the norm program's is checked)
    values = {(0, "grads", i): g for i, g in enumerate(grads)} | {(0, "factor", 0): factor}
    programs = _programs(lowered, "norm") + _programs(lowered, "scale")
    results = _run_on_cpu([(p.text, _arguments(lowered, k, values), [d for _, d in p.arguments]) for k, p in programs])
    (total, got_factor), *scaled_outs = results
    torch.testing.assert_close(torch.from_numpy(total), norm.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.from_numpy(got_factor), factor, rtol=1e-5, atol=1e-6)
    scaled = set()
    for (k, _), outs in zip(programs[1:], scaled_outs):
        for (_, i), out in zip(lowered.info["calls"][k], outs, strict=True):
            _assert_close(out, params[i].grad, i)
            scaled.add(i)
    assert scaled == set(range(len(grads)))


def test_the_1b_llama_update_and_clipping_compile_for_a_v5e_within_its_hbm():
    """The 16-layer Llama-3.2-1B shape's parameters (1.24B, bfloat16, the Trainer's two groups): a few graphs
    whatever the depth (one per bucket; the gate and up projections' 32 tensors, 3.2 GB with their moments, cut in two
    sub-lists of one graph), each compiled by libtpu for v5e-1; with the whole state resident (parameters, gradients,
    both moments: ~9.9 GB) and the largest program's outputs and temporaries beside it, the chip's HBM holds it
    (compile-only figures: a chip's allocator may add fragmentation)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        result = lower_and_compile("_tpu_compile_entries:lower_llama_optimizer", {"layers": 16}, "v5e-1")
    assert result.error is None, f"{result.error}\n at {result.where}"
    decayed, plain = entries.llama_shapes(16)
    groups = [["bfloat16", 0.01, False, decayed], ["bfloat16", 0.0, False, plain]]
    graphs = _buckets(groups)
    assert len(graphs) == 6 and (0, (8192, 2048), 16) in graphs, graphs
    assert [p.name for p in result.programs].count("adamw") == len(graphs)
    assert [p.name for p in result.programs].count("norm") == 1
    hbm = target("v5e-1").hbm_bytes
    params = sum(int(np.prod(s)) for s in decayed + plain)
    resident = 4 * 2 * params  # (bfloat16 parameters, gradients and both moments)
    for p in result.programs:
        assert p.compiled, f"{p.name}: {p.error}"
        assert p.peak_bytes < 4 << 30 and resident + p.output_bytes + p.temp_bytes < hbm, (p.name, p.peak_bytes)
    for warm in result.info["warm_eager"]:
        assert "aten.copy_.default" not in warm["ops"], warm


def _run_on_cpu(jobs: list[tuple[str, list[torch.Tensor], list[str]]]) -> list[list[np.ndarray]]:
    """hf_tpu.tpu_compile._xla.run_on_cpu of each (module text, arguments, the module's argument dtypes) in one process
    of its own (JAX on XLA:CPU, torch_tpu not loaded), each argument handed over in float32 and cast there to the
    module's dtype (numpy has no bfloat16); the results of each module in float32."""
    from _timeouts import SAFETY_TIMEOUT_S

    with tempfile.TemporaryDirectory() as tmp:
        for n, (text, tensors, _) in enumerate(jobs):
            np.savez(os.path.join(tmp, f"in{n}.npz"), *[t.float().numpy() for t in tensors])
            Path(tmp, f"module{n}.mlir").write_text(text)
        code = (
            "import os, numpy as np, jax.numpy as jnp\n"
            "from hf_tpu.tpu_compile._xla import run_on_cpu\n"
            f"tmp = {tmp!r}\n"
            f"for n, dtypes in enumerate({[dtypes for _, _, dtypes in jobs]!r}):\n"
            "    d = np.load(os.path.join(tmp, f'in{n}.npz'))\n"
            "    arrays = [d[f'arr_{i}'].astype(jnp.dtype(t)) for i, t in enumerate(dtypes)]\n"
            "    outs = run_on_cpu(open(os.path.join(tmp, f'module{n}.mlir')).read(), arrays)\n"
            "    np.savez(os.path.join(tmp, f'out{n}.npz'), *[np.asarray(o, dtype=np.float32) for o in outs])\n"
        )
        env = dict(os.environ, JAX_PLATFORMS="cpu", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=SAFETY_TIMEOUT_S)
        results = []
        for n in range(len(jobs)):
            d = np.load(os.path.join(tmp, f"out{n}.npz"))
            results.append([d[f"arr_{i}"] for i in range(len(d.files))])
        return results
