"""Run transformers' own model tests on the CPU and on the simulated tpu, and compare what passes.

transformers' test suite picks its device from two environment variables (``transformers/testing_utils.py``):
``TRANSFORMERS_TEST_BACKEND`` names a module it imports first (``hf_tpu.sim``: importing it enables the simulated
device) and ``TRANSFORMERS_TEST_DEVICE`` is the ``torch_device`` every test moves its models and inputs to. This
script runs the same test files twice, once plainly (CPU) and once with
``TRANSFORMERS_TEST_BACKEND=hf_tpu.sim TRANSFORMERS_TEST_DEVICE=tpu``, and lists every test whose outcome differs.

The tests are not in the transformers wheel: check out the tests of the installed version first, e.g.

    pip show transformers                    # Version: 5.24.0
    git clone --depth 1 -b v5.24.0 https://github.com/huggingface/transformers /tmp/transformers
    pip install parameterized               # the test suite's own dependency
    python scripts/run_transformers_tests.py /tmp/transformers tests/models/llama/test_modeling_llama.py

With ``--hf-tpu`` a third run has ``hf_tpu.enable("generation")`` on the simulated tpu (the pytest plugin
``scripts/_hf_tpu_generation_plugin.py``); the script then lists, per model family, how many tests ran hf_tpu's
generation loop and the names of those that did not, and every test that passes on the tpu with hf_tpu off but not
with it on:

    python scripts/run_transformers_tests.py --hf-tpu /tmp/transformers \
        tests/models/llama/test_modeling_llama.py tests/models/gpt2/test_modeling_gpt2.py -m generate

(``-m generate``: the tests of transformers' ``GenerationTesterMixin``; ``scripts/transformers_test_tree.py`` assembles
such a tree from a transformers git directory and the installed version's sdist, without network.)

Exits 1 when a test that passes on the CPU does not pass on the simulated tpu (with ``--hf-tpu``: or passes there
with hf_tpu off but not with it on).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TPU_ENV = {"TRANSFORMERS_TEST_BACKEND": "hf_tpu.sim", "TRANSFORMERS_TEST_DEVICE": "tpu"}


def outcomes(junit: Path) -> dict[str, str]:
    """``{test id: "passed" | "failed" | "error" | "skipped"}`` from a pytest junit XML report."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            result[name] = "failed"
        elif "error" in kinds:
            result[name] = "error"
        elif "skipped" in kinds:
            result[name] = "skipped"
        else:
            result[name] = "passed"
    return result


def run(root: Path, files: list[str], extra: list[str], env_extra: dict[str, str], junit: Path) -> dict[str, str]:
    """Run pytest on ``files`` under ``root`` with ``env_extra`` set; return the outcome of each test."""
    env = {k: v for k, v in os.environ.items() if k not in TPU_ENV}
    env.update(env_extra)
    env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # a torch-tpu install must not autoload on a chipless host
    # hf_tpu first, then what env_extra adds (the plugin's folder), then the caller's own PYTHONPATH
    extra_path = env_extra.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), extra_path, os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *extra, *files]
    print(f"$ {' '.join(f'{k}={v}' for k, v in env_extra.items())} {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=root, env=env, check=False)
    if not junit.exists():
        raise SystemExit(f"pytest wrote no report ({junit}); its output is above")
    return outcomes(junit)


def compare(cpu: dict[str, str], tpu: dict[str, str]) -> tuple[str, list[str]]:
    """A summary of both runs and the tests that pass on the CPU but not on the simulated tpu."""
    lines = []
    for device, res in (("cpu", cpu), ("tpu (simulated)", tpu)):
        counts = {k: sum(v == k for v in res.values()) for k in ("passed", "failed", "error", "skipped")}
        lines.append(f"{device:<16} " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    regressions = sorted(t for t, o in cpu.items() if o == "passed" and tpu.get(t) != "passed")
    differ = sorted(t for t in cpu.keys() | tpu.keys() if cpu.get(t) != tpu.get(t))
    lines.append(f"outcomes that differ: {len(differ)}")
    lines += [f"  {t}: cpu {cpu.get(t, 'absent')}, tpu {tpu.get(t, 'absent')}" for t in differ]
    return "\n".join(lines), regressions


def compare_hf_tpu(off: dict[str, str], on: dict[str, str], served: set[str]) -> tuple[str, list[str]]:
    """Per model family (``tests.models.<family>``): tests run, those that ran hf_tpu's loop (and passed), the names
    of those that did not (with their outcome), and the tests that pass with hf_tpu off but not with it on (the
    regressions)."""
    lines = []

    def family(test: str) -> str:  # tests.models.<family>, else the test's module and class
        parts = test.split("::")[0].split(".")
        return ".".join(parts[:3]) if parts[:2] == ["tests", "models"] else test.split("::")[0]

    for name in sorted({family(t) for t in on}):
        tests = [t for t in on if family(t) == name]
        ran = [t for t in tests if t in served]
        lines.append(
            f"{name}: {len(tests)} tests, {len(ran)} ran hf_tpu's loop "
            f"({sum(on[t] == 'passed' for t in ran)} passed); "
            f"passed: {sum(off.get(t) == 'passed' for t in tests)} with hf_tpu off, "
            f"{sum(on[t] == 'passed' for t in tests)} with it on"
        )
        missed = sorted(t for t in tests if t not in served)  # (each with its outcome with hf_tpu on)
        if missed:
            lines.append("  not on hf_tpu's loop: " + ", ".join(f"{t.split('::')[-1]} ({on[t]})" for t in missed))
    regressions = sorted(t for t, o in off.items() if o == "passed" and on.get(t) != "passed")
    lines.append(f"pass with hf_tpu off, not with it on: {len(regressions)}")
    lines += [f"  {t}: {on.get(t, 'absent')}{' (hf_tpu loop)' if t in served else ''}" for t in regressions]
    return "\n".join(lines), regressions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="a transformers checkout (the folder holding tests/)")
    p.add_argument("files", nargs="+", help="test files or node ids, relative to root")
    p.add_argument("-k", help="pytest -k expression")
    p.add_argument("-m", help="pytest -m marker expression ('generate': the GenerationTesterMixin tests)")
    p.add_argument("--pytest-args", default="", help="more pytest arguments, e.g. '-n 2'")
    p.add_argument("--hf-tpu", action="store_true", help="a third run with hf_tpu.enable('generation')")
    a = p.parse_args(argv)
    extra = [*(["-k", a.k] if a.k else []), *(["-m", a.m] if a.m else []), *a.pytest_args.split()]
    with tempfile.TemporaryDirectory(prefix="hf-tpu-tf-tests-") as tmp:
        cpu = run(a.root, a.files, extra, {}, Path(tmp) / "cpu.xml")
        tpu = run(a.root, a.files, extra, TPU_ENV, Path(tmp) / "tpu.xml")
        if a.hf_tpu:
            served_path = Path(tmp) / "served.json"
            env = {**TPU_ENV, "HF_TPU_LOOP_REPORT": str(served_path), "PYTHONPATH": str(REPO / "scripts")}
            on = run(a.root, a.files, ["-p", "_hf_tpu_generation_plugin", *extra], env, Path(tmp) / "on.xml")
            served = set(json.loads(served_path.read_text())) if served_path.exists() else set()
    summary, regressions = compare(cpu, tpu)
    print(summary)
    if a.hf_tpu:
        summary, more = compare_hf_tpu(tpu, on, served)
        print(summary)
        regressions += more
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
