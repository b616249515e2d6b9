"""The simulator makes the same choices as torch-tpu 0.2.0, checked against the wheel's own functions.

The simulator cannot run in a process where torch_tpu was autoloaded (its kernels own PrivateUse1; see
tests/test_coexistence.py), so its answers come from a subprocess of this environment started with
``TORCH_DEVICE_BACKEND_AUTOLOAD=0 HF_TPU_SIMULATE=1``, and this process calls the wheel's functions, none of which
initialise a device: the ``torch.compile`` wrapper and backend selection of ``torch_tpu._loader``, the body of its
``torch.set/get_float32_matmul_precision`` replacements (defined inside ``_init_device_impl``, which needs a chip, and
run here from the wheel's source over the wheel's compiled ``precision_impl``), and the ``torch.tpu`` functions that
refuse user calls (they raise before touching the device).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch_tpu._loader as loader
from torch._dynamo.backends import registry
from torch_tpu._internal import public_api
from torch_tpu._internal.device import _device_module as wheel_device_module
from torch_tpu._internal.precision import precision_impl
from torch_tpu._internal.utils import annotations

PRECISION_VALUES = ["medium", "high", "highest", "low", "HIGH", "", "float32", "tf32"]
COMPILE_CASES = [
    {},
    {"backend": None},
    {"backend": "tpu"},
    {"backend": "tpu", "dynamic": True},
    {"backend": "tpu", "dynamic": None},
    {"backend": "inductor"},
    {"backend": "aot_eager"},
    {"dynamic": True},
    {"mode": "reduce-overhead"},
]

SIM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import hf_tpu.sim
    from hf_tpu.sim import _compile, _device_module

    out = {}
    out["public"] = sorted(
        n for n in vars(torch.tpu) if not n.startswith("_") and not isinstance(getattr(torch.tpu, n), type(sys))
    )
    refusals = {}
    for name in out["public"]:
        obj = getattr(torch.tpu, name)
        target = obj.__init__ if isinstance(obj, type) else obj
        prefer = getattr(target, "__tt_api_prefer__", None)
        if prefer is None:
            continue
        try:
            obj(0) if name in ("set_device", "device") else obj()
        except RuntimeError as e:
            refusals[name] = [prefer, str(e)]
        else:
            refusals[name] = [prefer, None]
    out["refusals"] = refusals
    out["precision_initial"] = torch.get_float32_matmul_precision()
    precision = {}
    for value in json.loads(sys.argv[1]):
        try:
            torch.set_float32_matmul_precision(value)
            precision[value] = ["ok", torch.get_float32_matmul_precision()]
        except Exception as e:
            precision[value] = [type(e).__name__, str(e)]
    out["precision"] = precision
    out["inductor_error"] = _compile.INDUCTOR_TPU_ERROR
    seen = []
    compile_ = _compile._compile(lambda *a, **k: seen.append(k))
    cases = []
    for kwargs in json.loads(sys.argv[2]):
        seen.clear()
        compile_(lambda x: x, **kwargs)
        k = dict(seen[0])
        k["backend"] = "<selector>" if k["backend"] is _compile.default_backend_selector else k["backend"]
        cases.append(k)
    out["compile"] = cases
    out["select"] = {
        "cpu": _compile.select_backend([torch.ones(1)]),
        "tpu": _compile.select_backend([torch.ones(1), {"x": torch.ones(1, device="tpu")}]),
        "none": _compile.select_backend([3, None]),
    }
    print("SIM-JSON" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def sim() -> dict:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "HF_TPU_SIMULATE": "1"}
    env.pop("HF_TPU_EXPECT_TORCH_TPU", None)
    env.pop("HF_TPU_SIM_MATMUL_PRECISION", None)  # the simulator's own initial precision, as a user gets it
    proc = subprocess.run(
        [sys.executable, "-c", SIM_SCRIPT, json.dumps(PRECISION_VALUES), json.dumps(COMPILE_CASES)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SIM-JSON"))
    return json.loads(line[len("SIM-JSON") :])


class _OnChip(torch.Tensor):
    """Stands in for a tensor on a chip (this host has none, so "tpu" is not a device string here): torch_tpu's
    selection reads nothing but ``isinstance(x, torch.Tensor)`` and ``x.device.type``."""

    @property
    def device(self):  # type: ignore[override]
        return types.SimpleNamespace(type="tpu")


def _on_chip() -> torch.Tensor:
    return torch.Tensor._make_subclass(_OnChip, torch.ones(1))


def _wheel_precision_functions():
    """The wheel's ``_tpu_set_precision``/``_tpu_get_precision``, compiled from its source (see the module doc)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(loader._init_device_impl)))
    wanted = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name in ("_tpu_set_precision", "_tpu_get_precision")
    ]
    assert len(wanted) == 2, "torch_tpu._loader no longer defines its precision functions in _init_device_impl"
    namespace = {"functools": __import__("functools"), "torch": torch, "precision_impl": precision_impl}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), loader.__file__, "exec"), namespace)  # noqa: S102
    return namespace["_tpu_set_precision"], namespace["_tpu_get_precision"]


def test_precision_setter_accepts_and_refuses_what_the_wheels_does(sim):
    set_precision, get_precision = _wheel_precision_functions()
    before = precision_impl._get_global_precision()
    try:
        assert get_precision() == sim["precision_initial"] == "medium"  # precision_impl starts at DEFAULT
        for value in PRECISION_VALUES:
            try:
                set_precision(value)
                wheel = ["ok", get_precision()]
            except Exception as e:  # noqa: BLE001 - compare whatever the wheel raises
                wheel = [type(e).__name__, str(e)]
            assert sim["precision"][value] == wheel, value
    finally:
        precision_impl._set_global_precision(before)


def test_compile_wrapper_rules_match_the_wheels(sim, monkeypatch):
    seen = []
    monkeypatch.setattr(loader, "_torch_compile", lambda *a, **k: seen.append(k))
    wheel = []
    for kwargs in COMPILE_CASES:
        seen.clear()
        loader._default_tpu_compile(lambda x: x, **dict(kwargs))
        k = dict(seen[0])
        k["backend"] = "<selector>" if k["backend"] is loader._default_backend_selector else k["backend"]
        wheel.append(k)
    assert sim["compile"] == wheel


def test_backend_selection_matches_the_wheels(sim):
    cases = {"cpu": [torch.ones(1)], "tpu": [torch.ones(1), {"x": _on_chip()}], "none": [3, None]}
    for case, inputs in cases.items():
        chosen = loader._get_default_backend_impl(inputs)
        assert chosen is registry.lookup_backend(sim["select"][case]), case
    assert sim["select"]["tpu"] == "tpu"


def test_inductor_refusal_is_the_wheels(sim):
    assert sim["inductor_error"] == loader._INDUCTOR_TPU_ERROR
    with pytest.raises(RuntimeError) as info:
        loader._tpu_inductor_wrapper_call(types.SimpleNamespace(config={}), None, [_on_chip()])
    assert str(info.value) == sim["inductor_error"]


def _wheel_internal_names() -> dict[str, str]:
    """``torch.tpu`` exports torch_tpu marks internal, with the ``torch.accelerator`` function each one names."""
    found = {}
    cls = wheel_device_module.TpuDeviceModule
    for name in public_api._PUBLIC_MODULES["torch.tpu"].exports:
        raw = inspect.getattr_static(cls, name, None)
        target = getattr(raw, "__func__", raw)  # a classmethod, or a class (its metadata is on the class)
        if getattr(target, annotations.TT_API_STAGE, None) == annotations.Stage.INTERNAL.value:
            found[name] = getattr(target, annotations.TT_API_PREFER)
    return found


def test_torch_tpu_surface_and_refusals_match_the_wheels(sim):
    wheel_exports = set(public_api._PUBLIC_MODULES["torch.tpu"].exports)
    simulated = set(sim["public"])
    extra = simulated - wheel_exports
    assert not extra, f"the simulator's torch.tpu has names torch_tpu lacks: {extra}"
    assert wheel_exports - simulated == {
        "EagerMode",
        "allow_excess_precision",
        "eager_mode",
        "set_eager_mode",
        "topology_aware_mesh",
    }, "documented in docs/simulator.md as not simulated"
    internal = _wheel_internal_names()
    assert {name: prefer for name, (prefer, _) in sim["refusals"].items()} == internal
    for name in internal:
        with pytest.raises(RuntimeError) as info:
            fn = getattr(torch.tpu, name)
            fn(0) if name in ("set_device", "device") else fn()
        assert sim["refusals"][name][1] == str(info.value), name
