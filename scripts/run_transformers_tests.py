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

Exits 1 when a test that passes on the CPU does not pass on the simulated tpu.
"""

from __future__ import annotations

import argparse
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
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="a transformers checkout (the folder holding tests/)")
    p.add_argument("files", nargs="+", help="test files or node ids, relative to root")
    p.add_argument("-k", help="pytest -k expression")
    p.add_argument("--pytest-args", default="", help="more pytest arguments, e.g. '-n 2'")
    a = p.parse_args(argv)
    extra = [*(["-k", a.k] if a.k else []), *a.pytest_args.split()]
    with tempfile.TemporaryDirectory(prefix="hf-tpu-tf-tests-") as tmp:
        cpu = run(a.root, a.files, extra, {}, Path(tmp) / "cpu.xml")
        tpu = run(a.root, a.files, extra, TPU_ENV, Path(tmp) / "tpu.xml")
    summary, regressions = compare(cpu, tpu)
    print(summary)
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
