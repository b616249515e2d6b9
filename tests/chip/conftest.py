"""The chip tier (marker ``chip``): what the suite proves on the simulator, proved on a TPU chip against the CPU.

Run it on a TPU VM, alone, in one process (one program at a time holds a chip)::

    python -m pytest -m chip tests/chip -p no:xdist -p no:cacheprovider --chip-record chip.json

``HF_TPU_CHIP_TIER=simulate`` runs it on the simulated device (a CPU host); anywhere else every case is skipped with
that command (tests/chip/_chip_tier.py decides, reading the PCI bus: nothing opens a device at collection).

One chip, one process: torch_tpu opens the chip on the first device operation and keeps it until the process exits.
The cases that start processes of their own on the chip (``chip(order=0)``: the compile cache's two processes,
``hf-tpu serve``) run first, then ``hf-tpu selftest``'s checks in process (``order=1``: its exclusive checks want every
chip free), then the rest, which share the ``tpu`` fixture (the first to open the device).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _chip_tier import (
    RECORD_ENV,
    ChipRecords,
    Comparison,
    comparison_property,
    header,
    mark_device_opened,
    missing_packages,
    session_selects_tier,
    skip_and_order,
    tier_mode,
)

HERE = Path(__file__).parent
LOGIC_MODULE = "test_chip_tier_logic.py"  # the core tier's test of this plumbing: not a chip case
_MODE = pytest.StashKey()
_RECORDS = pytest.StashKey()
_CONFIG: list = []  # this session's config (pytest_runtest_logreport is given only the report)


def pytest_addoption(parser):
    parser.addoption("--chip-record", default=None, metavar="PATH",
                     help=f"write the chip tier's records (JSON) to PATH as the cases come (also {RECORD_ENV})")  # fmt: skip


def _is_chip_nodeid(nodeid: str) -> bool:
    return nodeid.startswith("tests/chip/") and LOGIC_MODULE not in nodeid


def pytest_configure(config):
    _CONFIG[:] = [config]
    mode = tier_mode(selected=session_selects_tier(config.getoption("markexpr", "") or ""))
    config.stash[_MODE] = mode
    path = config.getoption("chip_record", default=None) or os.environ.get(RECORD_ENV)
    if path and not hasattr(config, "workerinput"):  # the controller writes under xdist: reports all reach it
        config.stash[_RECORDS] = ChipRecords(path, header(mode))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Skip every chip case where the tier does not run (with the command that runs it); order the chip cases."""
    skip_and_order(items, config.stash[_MODE])


def pytest_runtest_logreport(report):
    records = _records_of(report)
    if records is not None and _is_chip_nodeid(report.nodeid):
        records.add(report)


def _records_of(report):
    if not _CONFIG:
        return None
    return _CONFIG[0].stash.get(_RECORDS, None)


# ---------------------------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def chip_mode(pytestconfig) -> str:
    """``"real"`` or ``"simulate"`` (skipped cases never get here)."""
    return pytestconfig.stash[_MODE].mode


@pytest.fixture(scope="session")
def backend(chip_mode):
    """The ``tpu`` device registered in this process, not yet opened: torch_tpu's backend on a chip (as its autoload
    at ``import torch`` would: tests/conftest.py turns the autoload off), the simulated device otherwise."""
    import torch

    import hf_tpu

    if chip_mode == "simulate":
        import torch

        import hf_tpu.sim

        hf_tpu.sim.enable()  # (emulating the chip's float32 matmul precision)
        torch.set_float32_matmul_precision("medium")  # torch_tpu's default (the suite's simulator runs 'highest')
    else:
        _load_torch_tpu()
        hf_tpu.runtime.detect.cache_clear()
    info = hf_tpu.runtime.detect()
    assert info.mode == ("real" if chip_mode == "real" else "simulated"), info
    return info


def _load_torch_tpu() -> None:
    import importlib
    import importlib.metadata

    import torch

    try:
        torch.device("tpu")
        return  # already registered (the autoload ran)
    except RuntimeError:
        pass
    for ep in importlib.metadata.entry_points(group="torch.backends"):
        if ep.value.split(":", 1)[0].split(".", 1)[0] == "torch_tpu":
            ep.load()()
            return
    importlib.import_module("torch_tpu")


@pytest.fixture(scope="session")
def tpu(backend):
    """The opened ``tpu`` device with every hf_tpu integration on: ``"tpu"``. Float32 matmuls at the device's
    default precision (torch_tpu's ``'medium'``; the simulator emulates it) unless a case asks otherwise."""
    import torch

    import hf_tpu

    mark_device_opened()
    assert torch.equal(torch.arange(4.0).to("tpu").cpu(), torch.arange(4.0))
    with hf_tpu.enabled():
        yield "tpu"


class ChipCase:
    """A case's comparisons against the CPU; each is recorded (the worst goes to the row) and then asserted."""

    def __init__(self, node) -> None:
        self.node = node
        self.computed_at: str | None = None  # the precision the last chip.precision block ran at

    def _record(self, c: Comparison) -> None:
        self.node.user_properties.append(comparison_property(c))

    def close(self, actual, expected, *, layers: int = 1, precision: str | None = None, what: str = "the result"):
        """Float32 ``actual`` (on the device) against the CPU's at the matmul precision in force (or ``precision``):
        :func:`hf_tpu.numerics.assert_close_to_cpu`. Returns the error."""
        from hf_tpu import numerics

        precision = precision or numerics.matmul_precision()
        err = numerics.max_error(actual, expected)
        self._record(Comparison(what, precision, numerics.float32_tolerance(precision, layers=layers), err))
        return numerics.assert_close_to_cpu(actual, expected, precision=precision, layers=layers, what=what)

    def bf16_close(
        self, actual, expected, *, tolerance: float | None = None, layers: int = 4, what: str = "the result"
    ) -> float:
        """bfloat16 results: ``max|tpu - cpu| / max|cpu|`` at most ``tolerance`` (default: one bf16 unit per layer,
        :func:`hf_tpu.numerics.bfloat16_tolerance`; 4 layers as the float32 checks count a 2-layer model)."""
        from hf_tpu import numerics

        tolerance = numerics.bfloat16_tolerance(layers) if tolerance is None else tolerance
        err = numerics.max_error(actual.float(), expected.float())
        self._record(Comparison(what, "bfloat16", tolerance, err))
        assert err <= tolerance, f"{what}: max|tpu - cpu| / max|cpu| = {err:.3g} > {tolerance:.3g} (bfloat16)"
        return err

    def tokens(self, got, want, *, what: str = "greedy tokens", allowed: int = 0, precision: str | None = None) -> int:
        """Token ids equal the CPU's: ``max_err`` is the number of positions that differ (``tolerance`` 0)."""
        import torch

        from hf_tpu import numerics

        got, want = torch.as_tensor(got).cpu(), torch.as_tensor(want).cpu()
        differ = int((got != want).sum()) if got.shape == want.shape else max(got.numel(), want.numel())
        self._record(
            Comparison(
                what, precision or self.computed_at or numerics.matmul_precision(), float(allowed), float(differ)
            )
        )
        assert differ <= allowed, (
            f"{what}: {differ} token(s) differ from the CPU's\n tpu: {got.tolist()}\n cpu: {want.tolist()}"
        )
        return differ

    def count(self, value: float, *, allowed: float = 0, what: str, detail: str = "") -> None:
        """A count held to ``allowed`` (graphs compiled by a second process, ...): recorded as ``max_err``."""
        self._record(Comparison(what, None, float(allowed), float(value)))
        assert value <= allowed, f"{what}: {value} (allowed {allowed})\n{detail}".rstrip()

    @contextlib.contextmanager
    def precision(self, value: str):
        """Float32 matmuls at ``value`` for the block (``'highest'`` where greedy tokens are compared with the
        CPU's), the previous precision restored after; token comparisons after it record ``value``."""
        import torch

        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(value)
        self.computed_at = value
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)


@pytest.fixture
def chip(request) -> ChipCase:
    """This case's comparisons: ``chip.close``, ``chip.bf16_close``, ``chip.tokens``, ``chip.count``,
    ``chip.precision('highest')``."""
    return ChipCase(request.node)


@pytest.fixture
def needs():
    """``needs("diffusers", ...)``: skip the case, naming what to pip install, when a package is missing."""

    def check(*packages: str) -> None:
        reason = missing_packages(*packages)
        if reason:
            pytest.skip(reason)

    return check
