"""``hf-tpu selftest``'s checks in this process (:func:`hf_tpu.selftest.run_checks`): none fails.

It runs right after the cases with processes of their own (``chip(order=1)``) and before anything else here opens
the device, because its exclusive checks (``tensor_parallel``) start ranks that want every chip. A check may be
skipped only for what one chip cannot do (tensor parallelism) or for a package this machine lacks (named in the
reason). On the simulated device the tier stands for one chip: ``tensor_parallel`` is left out (the suite runs it).
"""

from __future__ import annotations

import pytest
from _chip_tier import mark_device_opened

pytestmark = pytest.mark.chip(order=1)

# What a skip may say: one chip, or a package to install.
ALLOWED_SKIPS = ("2 or more TPU devices", "pip install", "is not installed", "simulated device", "simulator")


def test_every_selftest_check_passes_in_process(backend, chip_mode, chip, needs):
    needs("transformers")
    from hf_tpu.selftest import checks, discover, run_checks

    discover()
    only = [name for name in checks() if not (chip_mode == "simulate" and name == "tensor_parallel")]
    mark_device_opened()
    results = run_checks(only=only)
    failed = [r for r in results if r.status == "failed"]
    summary = "\n".join(f"{r.name}: {r.status} {r.reason or ''} {(r.error or '')[-1500:]}" for r in results)
    chip.count(len(failed), what="selftest checks failed", detail=summary)
    odd = [r for r in results if r.status == "skipped" and not any(s in (r.reason or "") for s in ALLOWED_SKIPS)]
    assert not odd, summary
    assert {r.name for r in results if r.status == "passed"} >= {"runtime", "device", "compile"}, summary
