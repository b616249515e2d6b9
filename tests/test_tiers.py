"""The test tiers' machinery: what ``.ci/run`` relies on to run the slow and contract tiers in parallel.

``.ci/run`` runs those tiers with ``-n 2 --dist loadgroup``: tests marked ``xdist_group`` (the Ray examples, one
cluster at a time; the contract tests that share a module-scoped lowering) must run on one worker. pytest-xdist 3.8
under pytest 9.2 silently stops grouping (pytest-xdist issue #1386), so pyproject.toml keeps pytest below 9.2; this
module checks that the groups hold in the installed pair, and that the durations file keeps one name per test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from _timeouts import SAFETY_TIMEOUT_S

REPO = Path(__file__).resolve().parents[1]


def test_an_xdist_group_runs_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(
        textwrap.dedent(
            """
            import os

            import pytest


            @pytest.mark.xdist_group("together")
            @pytest.mark.parametrize("i", range(6))
            def test_grouped(i):
                with open(os.path.join(os.environ["GROUPED_OUT"], f"grouped-{i}"), "w") as f:
                    f.write(os.environ["PYTEST_XDIST_WORKER"])


            @pytest.mark.parametrize("i", range(6))
            def test_free(i):
                pass
            """
        )
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # (not the repository's addopts and markers)
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2", "--dist", "loadgroup",
         "test_grouped.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S,
        env={**os.environ, "GROUPED_OUT": str(out)},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    workers = {(out / f"grouped-{i}").read_text() for i in range(6)}
    assert len(workers) == 1, f"the group ran on {sorted(workers)}: --dist loadgroup does not group here"


def test_durations_keep_one_name_per_test_under_loadgroup(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import test_durations
    finally:
        sys.path.remove(str(REPO / "scripts"))
    junit = tmp_path / "run.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.contract.test_x" name="test_a@test_x::lowered" time="2.5"/>'
        '<testcase classname="tests.contract.test_x" name="test_b[v5e-1]@ray" time="1.0"/>'
        '<testcase classname="tests.contract.test_x" name="test_c[a@b]" time="0.5"/>'
        "</testsuite></testsuites>"
    )
    assert test_durations.read_junit(junit) == {
        "tests/contract/test_x::test_a": 2.5,
        "tests/contract/test_x::test_b[v5e-1]": 1.0,
        "tests/contract/test_x::test_c[a@b]": 0.5,
    }


def test_failures_name_each_failed_test_with_its_message(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import test_durations
    finally:
        sys.path.remove(str(REPO / "scripts"))
    (tmp_path / "slow.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.serving.test_x" name="test_ok" time="1"/>'
        '<testcase classname="tests.serving.test_x" name="test_bad[a]@ray" time="2">'
        '<failure message="AssertionError: tokens differ&#10;assert [1, 2] == [1, 3]">long traceback</failure>'
        "</testcase>"
        '<testcase classname="tests.docs.test_docs" name="test_setup" time="0">'
        "<error>fixture 'x' not found</error></testcase>"
        "</testsuite></testsuites>"
    )
    (tmp_path / "core.xml").write_text('<testsuites><testsuite name="pytest">'
                                       '<testcase classname="tests.test_y" name="test_ok" time="1"/>'
                                       "</testsuite></testsuites>")  # fmt: skip
    assert test_durations.main(["failures", str(tmp_path / "core.xml"), str(tmp_path / "slow.xml")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "2 tests failed or errored:",
        "  FAILED slow:tests/serving/test_x::test_bad[a]",
        "      AssertionError: tokens differ",
        "      assert [1, 2] == [1, 3]",
        "  ERROR slow:tests/docs/test_docs::test_setup",
        "      fixture 'x' not found",
    ]
    assert test_durations.main(["failures", str(tmp_path / "core.xml")]) == 0
    assert capsys.readouterr().out.strip() == "no test failed or errored in core.xml"
