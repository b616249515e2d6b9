"""Every script in examples/ runs on the simulated device as its docstring says, and prints what it promises."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from _timeouts import SAFETY_TIMEOUT_S

REPO = Path(__file__).resolve().parents[1]

# script -> (extra arguments, fragments its output must contain)
EXAMPLES = {
    "simulator_counters.py": ([], ["strict mode caught: host sync", "tokens: ["]),
    "device_map.py": ([], ["device_map='auto' with max_memory=", "'cpu'", "refused: device_map='auto'"]),
    "moe_kernel.py": ([], ["ragged_dot_tpu: 5 forwards", "signatures    0, host syncs    0", "identical: True"]),
    "generate.py": ([], ["compiles after warm-up: 0"]),
    "finetune.py": ([], ["tpu  losses per step", "0 compiles, 0 new eager shapes"]),
    "diffusers_sd3.py": (["--out", "sd3.png"], ["largest difference to the CPU image", "wrote sd3.png"]),
    "encoders.py": ([], ["feature-extraction: 64 texts, 0 compiles after warm-up", "encoder warm-up: 6 graphs"]),
}


def _numbers(pattern: str, out: str) -> list[float]:
    """Every number ``pattern``'s one group captures in ``out`` (whole lines), as floats."""
    return [float(v) for v in re.findall(pattern, out, re.MULTILINE)]


def _device_map_logits_equal_cpu(out: str) -> None:
    # both placements (whole model on the chip; 'auto' with layers offloaded to the CPU) give the CPU's logits
    assert _numbers(r"^  max \|logits - cpu\| = (\S+)$", out) == [0.0, 0.0], out[-4000:]


def _sd3_image_close_to_cpu(out: str) -> None:
    (diff,) = _numbers(r"^largest difference to the CPU image: (\S+)$", out)
    assert diff <= 1e-5, out[-4000:]  # float32, values in [0, 1]


def _encoders_equal_cpu(out: str) -> None:
    diffs = _numbers(r"compiles after warm-up, max difference (\S+)$", out)
    assert diffs and all(d <= 1e-5 for d in diffs), out[-4000:]  # float32 embeddings, bucketed vs unpadded
    assert _numbers(r"^sentence-transformers: (\d+) compiles", out) in ([], [0.0]), out[-4000:]


# script -> (extra arguments, fragments its output must contain), run in the slow tier (a Ray cluster of simulated VMs)
SLOW_EXAMPLES = {
    "ray_batch.py": (["--prompts", "64", "--check-cpu"], [
        "64 rows back of 64 prompts, 0 with an error, 64 distinct ids",
        "64 of 64 rows equal the CPU's greedy generate, token for token",
        "0 graphs compiled, 2 from the compile cache",
    ]),
}


# script -> checks of the values its output reports (not only that it reports them)
VALUES = {
    "device_map.py": [_device_map_logits_equal_cpu],
    "diffusers_sd3.py": [_sd3_image_close_to_cpu],
    "encoders.py": [_encoders_equal_cpu],
}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(HF_TPU_SIMULATE="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    return env


def test_every_example_is_covered():
    assert {p.name for p in (REPO / "examples").glob("*.py")} == {*EXAMPLES, *SLOW_EXAMPLES, "tp_generate.py"}


_RAY = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (.ci/run: --dist loadgroup)


@pytest.mark.parametrize("script", [*EXAMPLES, *(pytest.param(name, marks=_RAY) for name in SLOW_EXAMPLES)])
def test_example_runs_on_the_simulator(script, tmp_path, tmp_path_factory, request):
    if script in SLOW_EXAMPLES:
        pytest.importorskip("ray")
    args, expected = {**EXAMPLES, **SLOW_EXAMPLES}[script]
    if script in SLOW_EXAMPLES:  # Ray puts its sockets under $TMPDIR/ray/session_<date>/sockets: 107 bytes at most
        tmpdir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        request.addfinalizer(lambda: shutil.rmtree(tmpdir, ignore_errors=True))
    else:
        tmpdir = tmp_path_factory.mktemp("tmpdir")
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / script), *args],
        cwd=tmp_path, env={**_env(), "TMPDIR": str(tmpdir)}, capture_output=True, text=True,
        timeout=SAFETY_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for fragment in expected:
        assert fragment in proc.stdout, (fragment, proc.stdout[-4000:])
    for check in VALUES.get(script, ()):
        check(proc.stdout)
    if script == "diffusers_sd3.py":
        assert (tmp_path / "sd3.png").stat().st_size > 0
    # nothing lands in the working directory (a checkout's root) but the file the command line named
    assert {p.name for p in tmp_path.iterdir()} <= {"sd3.png"}
    # and the example's temporary checkpoints and outputs are gone (torch's own caches may stay)
    assert not [p.name for p in tmpdir.iterdir() if p.name.startswith(("hf_tpu", "hf-tpu"))]


def test_every_example_says_how_to_run_it_the_readme_way():
    """One way to run them everywhere: ``HF_TPU_SIMULATE=1 python examples/<name>.py`` (the README's), or through
    the launcher for the tensor-parallel one; no ``PYTHONPATH=.`` (the README installs the package)."""
    readme = (REPO / "README.md").read_text()
    assert "HF_TPU_SIMULATE=1 python examples/<name>.py" in readme
    for path in sorted((REPO / "examples").glob("*.py")):
        doc = path.read_text().split('"""')[1]
        assert "PYTHONPATH=." not in doc, path.name
        way = "hf-tpu launch --simulate" if path.name == "tp_generate.py" else "HF_TPU_SIMULATE=1 python"
        assert f"{way} " in doc and f"examples/{path.name}" in doc, path.name


def test_the_moe_example_without_jax_names_the_extra_to_install(tmp_path):
    """The README's demo install has no jax: one line naming the extra, not a traceback from deep in the kernel."""
    code = (
        "import runpy, sys; sys.modules['jax'] = None; "  # `import jax` now fails, as where jax is not installed
        f"runpy.run_path({str(REPO / 'examples' / 'moe_kernel.py')!r}, run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
        timeout=SAFETY_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "examples/moe_kernel.py needs jax, which is not installed: pip install 'hf-tpu[kernels]'"
    )


def test_tensor_parallel_example_runs_on_two_simulated_chips():
    """docs/first_hour.md's launch of this example (the page's block is not run again by tests/docs: this test runs
    the command, from the checkout's root as the page does, and compares what it printed with the page's output)."""
    sys.path.insert(0, str(REPO / "tests" / "distributed"))
    from _launch_util import launch, processes_mentioning

    from docs import pages

    command = "hf-tpu launch --simulate --nproc_per_node=2 examples/tp_generate.py --compare"
    code, out, _ = launch(command.split()[2:], timeout=SAFETY_TIMEOUT_S)
    assert code == 0, out[-4000:]
    for rank in (0, 1):
        assert f"[rank {rank}] TP=2 greedy output equals the unsharded model's: True" in out, out[-4000:]
    shown = pages.shown_output("docs/first_hour.md", command)
    assert pages.match_output(shown, out) is None, pages.match_output(shown, out)
    assert not processes_mentioning("tp_generate.py"), "ranks left running after the launcher exited"
