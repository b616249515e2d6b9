"""pytest plugin for ``scripts/run_transformers_tests.py --hf-tpu``: runs a test session with
``hf_tpu.enable("generation")`` on the simulated tpu, and records which tests ran hf_tpu's generation loop (written as JSON to the path in
``HF_TPU_LOOP_REPORT``: the tests' junit ids, ``module.Class::test``, as the script reads them from the junit report).

Loaded with ``-p _hf_tpu_generation_plugin`` and this folder on ``PYTHONPATH`` (the script does both)."""

from __future__ import annotations

import json
import os

_CURRENT: list[str] = []
_SERVED: set[str] = set()


def _junit_id(item) -> str:
    path, *parts = item.nodeid.split("::")
    module = path[:-3].replace("/", ".") if path.endswith(".py") else path.replace("/", ".")
    return ".".join([module, *parts[:-1]]) + "::" + parts[-1]


def pytest_configure(config) -> None:
    import hf_tpu
    import hf_tpu.sim
    from hf_tpu.transformers import generation

    hf_tpu.sim.enable()
    hf_tpu.enable("generation")
    loop = generation.run_loop

    def recorded(*args, **kwargs):  # the custom_generate hf_tpu hands upstream's generate: hf_tpu's loop runs
        if _CURRENT:
            _SERVED.add(_CURRENT[-1])
        return loop(*args, **kwargs)

    generation.run_loop = recorded


def pytest_runtest_setup(item) -> None:
    _CURRENT.append(_junit_id(item))


def pytest_runtest_teardown(item) -> None:
    _CURRENT.clear()


def pytest_sessionfinish(session) -> None:
    path = os.environ.get("HF_TPU_LOOP_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(sorted(_SERVED), f)
