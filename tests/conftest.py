"""Test-suite set-up: every test runs with the simulated ``tpu`` device registered in this process.

torch_tpu must not autoload on a host without chips (libtpu would look for the cloud metadata server), so
autoload is turned off before torch is imported.

The simulated device computes float32 matmuls as a chip does, at torch_tpu's default precision, ``'medium'`` (one
bfloat16 pass). Most tests compare a ``tpu`` result with the CPU's exactly (greedy tokens, logits equal, losses step by
step): the suite runs them at ``'highest'`` (float32, what a user sets with ``torch.set_float32_matmul_precision`` for
exact results on a chip), through ``HF_TPU_SIM_MATMUL_PRECISION``, which every process a test starts (CLI runs,
launched ranks, Ray workers, docs commands) inherits. A test of the chip's numerics marks itself
``@pytest.mark.tpu_precision("medium")`` and compares with :mod:`hf_tpu.numerics`' tolerances. Run the suite with
``HF_TPU_SIM_MATMUL_PRECISION=medium`` to see which comparisons the default precision breaks.

One intra-op thread per test process (``OMP_NUM_THREADS=1`` unless set, inherited by the processes tests start): the
README's command runs two workers on a 2-core host, and the tiny models' ops gain nothing from a second thread that
the other worker is using (a generation file ran 14% faster so). The CPU references run in the same setting.
"""

import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_TPU_SIM_MATMUL_PRECISION", "highest")  # see above; read once per process by hf_tpu.sim


def pytest_sessionstart(session):
    """In CI every optional dependency of the test command is installed: a missing one is a failure there, so that
    the tests that need it (jax for the kernels, peft for LoRA, torchao and compressed-tensors for quantization,
    fastapi/uvicorn/openai/prometheus_client for tests/serving, sentence-transformers for tests/encoders) cannot be
    skipped unnoticed."""
    if os.environ.get("HF_TPU_EXPECT_RAY") == "1":  # .ci/run's slow tier installs the [ray] extra for tests/ray
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise RuntimeError("HF_TPU_EXPECT_RAY=1 but ray is not installed: pip install -e '.[ray]'")
    if os.environ.get("CI", "").lower() != "true":
        return
    import importlib.util

    wanted = ("jax", "peft", "torchao", "compressed_tensors", "fastapi", "uvicorn", "openai", "prometheus_client",
              "sentence_transformers")
    missing = [name for name in wanted if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"CI=true but {', '.join(missing)} not installed: the test command installs .[test,kernels,quant,serve]"
        )


import gc  # noqa: E402

import pytest  # noqa: E402  (after the environment above, which must precede torch)


# The garbage collector in a test process: the suite's time goes mostly to dynamo tracing graphs, which allocates
# millions of objects, so the default thresholds ran thousands of young collections and a dozen full ones (each walking
# the ~430,000 objects torch, transformers and hf_tpu leave: 0.2-0.7 s) per test file: about 10% of its CPU
# (tests/transformers/test_generation.py alone: 42.0 -> 38.0 CPU-s). Here the young generation is collected every
# 50,000 allocations instead of 700, and what the imports and collection left is frozen (never walked again) once
# collection ends, and everything at the session's end (the interpreter's exit would walk it all once more). Tests that
# need their garbage gone call gc.collect() as before; only when the collector runs changes, never what it frees.
gc.set_threshold(50_000, 20, 10)


def pytest_collection_finish(session):
    gc.freeze()


def pytest_unconfigure(config):
    gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker
def pytest_collection_modifyitems(config, items):
    """The slow tier (``tests/_tiers.py``): the tests it names get the ``slow`` marker, which the README's command
    deselects (pyproject.toml's addopts) and ``.ci/run`` runs as a step of its own."""
    from _tiers import mark_slow

    # a stale entry is checked when whole files are collected, not when tests are picked by node id (path::test)
    mark_slow(items, check_stale=not any("::" in str(arg) for arg in config.args))


@pytest.fixture(autouse=True)
def _process_state_restored():
    """Each test leaves ``os.environ`` and the float32 matmul precision as it found them, whatever it ran in this
    process: a later test on the same worker (``-n 2`` deals tests out by timing, so which one follows which differs
    from run to run) must not inherit them, nor the processes it starts. ``hf-tpu launch`` run in process, for one,
    sets its workers' ``PYTHONPATH`` (and, simulated, the generation and HBM they simulate) in its own environment on
    purpose: tests/distributed/test_launch.py's bootstrap test left ``PYTHONPATH`` behind, and a later test on that
    worker saw it (48b7a39). What changed is undone and said, naming the variables
    (pytest's own ``PYTEST_CURRENT_TEST`` aside) in a ``UserWarning`` that starts "environment leak" (a plain class:
    xdist's controller rebuilds a worker's warning from its class's module by name, and ``conftest`` names
    tests/contract/conftest.py there when that tier runs, which crashed the contract tier's workers)."""
    import sys
    import warnings

    environ = dict(os.environ)
    torch = sys.modules.get("torch")
    precision = torch.get_float32_matmul_precision() if torch is not None else None
    yield
    changed = sorted(k for k in environ.keys() | os.environ.keys()
                     if environ.get(k) != os.environ.get(k) and k != "PYTEST_CURRENT_TEST")  # fmt: skip
    if changed:
        for k in changed:
            if k in environ:
                os.environ[k] = environ[k]
            else:
                del os.environ[k]
        warnings.warn(f"environment leak: os.environ changed, undone: {', '.join(changed)}", stacklevel=1)
    if precision is not None:  # (torch imported by the test itself: its first setting is the process's own)
        now = torch.get_float32_matmul_precision()
        if now != precision:
            torch.set_float32_matmul_precision(precision)
            warnings.warn(f"environment leak: float32 matmul precision {now!r}, undone to {precision!r}", stacklevel=1)


@pytest.fixture(autouse=True)
def _tpu_precision(request):
    """``@pytest.mark.tpu_precision("medium")``: the simulated device at that float32 matmul precision (emulation on)
    for the test; the suite's precision (``HF_TPU_SIM_MATMUL_PRECISION``) restored after it."""
    marker = request.node.get_closest_marker("tpu_precision")
    if marker is None:
        yield
        return
    import torch

    import hf_tpu.sim

    hf_tpu.sim.enable()
    torch.set_float32_matmul_precision(marker.args[0])
    try:
        yield
    finally:
        hf_tpu.sim.enable()
        torch.set_float32_matmul_precision(os.environ.get("HF_TPU_SIM_MATMUL_PRECISION") or "medium")
