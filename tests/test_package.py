"""Package-level promises: ``import hf_tpu`` is light, and CI runs exactly the README's test command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _timeouts import SAFETY_TIMEOUT_S

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch_tpu", "jax", "transformers", "diffusers")


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "HF_TPU_SIMULATE"}
    full_env.update(env, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", code],
        env=full_env,
        check=False,
        capture_output=True,
        text=True,
        timeout=SAFETY_TIMEOUT_S,
    )


def test_import_hf_tpu_imports_no_backend_or_hf_library():
    code = (
        "import sys, hf_tpu, hf_tpu.runtime, hf_tpu.cli.main\n"
        "hf_tpu.runtime.detect()\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    proc = run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_import_with_simulate_still_imports_no_hf_library():
    """HF_TPU_SIMULATE=1 registers the simulated device (torch is needed) but pulls in no HF library."""
    proc = run(f"import sys, hf_tpu\nprint([m for m in {HEAVY!r} if m in sys.modules])", HF_TPU_SIMULATE="1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def readme_commands() -> list[str]:
    """The command lines in README.md's bash blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command_verbatim():
    readme_test = [line for line in readme_commands() if "pytest" in line]
    assert len(readme_test) == 1, readme_test
    proc = subprocess.run(
        ["bash", str(REPO / ".ci" / "run"), "--print-test-command"],
        check=False,
        capture_output=True,
        text=True,
        timeout=SAFETY_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == readme_test[0]
    # It installs torch 2.13.0 before anything else (so pip keeps the CPU build), with the test, kernels, quant and
    # serve extras.
    assert re.search(r'pip install torch==2\.13\.0 -e "\.\[test,kernels,quant,serve\]"', readme_test[0])


# Fixed waits around real work: a literal timeout, a pytest-timeout mark, a deadline a literal number of seconds
# away, a module constant holding a timeout (tests/_timeouts.py's SAFETY_TIMEOUT_S is the one allowed), and a
# wall-clock assertion: "assert <end> - <start> < 30" or an assertion on a time.time()/monotonic()/perf_counter().
FIXED_WAIT = re.compile(
    r"\btimeout=\d|mark\.timeout\(|communicate\(timeout=\d|deadline = time\.\w+\(\) \+ \d"
    r"|^\s*[A-Z_]*TIMEOUT[A-Z_]* = \d"
    r"|\bassert\b.*\b\w+ - \w+ <=? \d"
    r"|\bassert\b.*time\.(time|monotonic|perf_counter)\(\).*[<>]=? ?\d"
)


def fixed_waits(root: Path, allowed: tuple[Path, ...] = ()) -> list[str]:
    """``path:line: text`` of every line under ``root`` that :data:`FIXED_WAIT` matches."""
    return [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if path not in allowed
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if FIXED_WAIT.search(line)
    ]


def test_no_test_waits_on_a_fixed_short_timeout():
    """A slow machine must not fail a test: subprocesses get the one safety timeout (tests/_timeouts.py), below
    pytest-timeout's (pyproject.toml), no test sets a shorter pytest-timeout of its own or asserts on wall-clock
    time, and hf_tpu's own code puts no fixed timeout around real work either."""
    import tomllib

    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert SAFETY_TIMEOUT_S >= 1200 and ini["timeout"] > SAFETY_TIMEOUT_S
    allowed = (REPO / "tests" / "_timeouts.py", REPO / "tests" / "test_package.py")  # the safety timeout; examples
    found = fixed_waits(REPO / "tests", allowed) + fixed_waits(REPO / "hf_tpu")
    assert not found, "fixed timeouts or wall-clock assertions around real work (use SAFETY_TIMEOUT_S):\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    "line",
    [
        'assert done - raised < 30, f"the launcher took {done - raised:.1f}s"',
        "assert time.time() - start < 5",
        "    output, _ = proc.communicate(timeout=600)",
        "_TIMEOUT_S = 600",
        "deadline = time.monotonic() + 30",
        "@pytest.mark.timeout(60)",
    ],
)
def test_the_fixed_wait_guard_catches_each_form(line):
    assert FIXED_WAIT.search(line), line
