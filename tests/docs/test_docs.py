"""README.md and docs/*.md, run: python blocks, the commands a page tells a user to run, their outputs compared.

The conventions a page follows are in tests/docs/pages.py. Command blocks marked heavy on their page run in the
``docs_heavy`` group (``python -m pytest -m docs_heavy tests/docs``; .ci/run runs it in its slow step); the README's test command
deselects them (``addopts`` in pyproject.toml).
"""

from __future__ import annotations

import json

import pytest
from sybil import Document

from docs.pages import PAGES, ROOT, Commands, NotRun, PageParser, Problem


def _parse(page: str) -> Document:
    return Document.parse(str(ROOT / page), PageParser())


def _examples(page: str, kinds: tuple[type, ...]):
    return [ex for ex in _parse(page).examples() if isinstance(ex.parsed, kinds)]


def _command_params():
    params = []
    for page in PAGES:
        for ex in _examples(page, (Commands,)):
            marks = [pytest.mark.docs_heavy] if ex.parsed.heavy else []
            params.append(pytest.param(page, ex.line, marks=marks, id=f"{page}:{ex.line}"))
    return params


def _python_pages():
    return [page for page in PAGES if any(not isinstance(ex.parsed, (Commands, NotRun, Problem))
                                          for ex in _parse(page).examples())]


@pytest.mark.parametrize("page", PAGES)
def test_every_block_is_run_or_says_why_not(page):
    """Blocks the suite does not run still hold: python compiles, hf-tpu flags parse, files named exist; a block
    nobody checks is marked with its reason."""
    failures = []
    for ex in _examples(page, (NotRun, Problem)):
        message = ex.region.evaluator(ex)
        if message:
            failures.append(f"{page}, line {ex.line}: {message}")
    assert not failures, "\n".join(failures)


@pytest.mark.tpu_precision("medium")
@pytest.mark.parametrize("page", _python_pages())
def test_python_blocks_run(page):
    """The page's python blocks, in order, in one namespace (each page's hf_tpu.enable() undone after, the
    simulated device back at its defaults), at torch_tpu's default float32 matmul precision, as a reader runs them."""
    import hf_tpu
    import hf_tpu.sim

    document = _parse(page)
    try:
        for ex in document.examples():
            if not isinstance(ex.parsed, (Commands, NotRun, Problem)):
                ex.evaluate()
    finally:
        hf_tpu.disable()
        hf_tpu.sim.enable()


@pytest.mark.parametrize(("page", "line"), _command_params())
def test_commands_print_what_the_page_shows(page, line):
    (example,) = [ex for ex in _examples(page, (Commands,)) if ex.line == line]
    message = example.region.evaluator(example)
    assert message is None, f"{page}, line {line}: {message}"


def test_the_readme_quotes_the_architecture_sweep_from_its_generated_table():
    """Figures in prose come from the generated table (issue 36): the README's sweep counts are docs/architectures.md's
    (written by ``python benchmarks/arch_sweep.py --write-docs``), which said 196 / 179 of 190 after the table had
    moved on to 200 / 182 of 193."""
    import re

    table = (ROOT / "docs" / "architectures.md").read_text()
    total = re.search(r"^(\d+) architectures; of the \d+ measured, (\d+) buildable", table, re.M)
    target = re.search(r"meet every target: (\d+) of (\d+) measured \(([\d.]+)%\)", table)
    assert total and target, "docs/architectures.md's summary lines changed: update this test's patterns"
    readme = (ROOT / "README.md").read_text()
    quoted = f"all {total[1]} architectures on the final code: {target[1]} of {target[2]} buildable architectures " \
             f"meet every target, {target[3]}%"  # fmt: skip
    assert quoted in readme, f"README.md should quote docs/architectures.md: '{quoted}'"


def test_run_the_tests_quotes_the_suite_settings_and_names_files_that_exist():
    """docs/first_hour.md's "Run the tests" quotes no measured time or test count (they were typed by hand and went
    stale: "763 tests", "about 13 minutes"); the figures it does quote are settings, read here from where they are
    set, and the test files its table names exist."""
    import re
    import tomllib

    from _timeouts import SAFETY_TIMEOUT_S

    section = (ROOT / "docs" / "first_hour.md").read_text().split("## 7. Run the tests", 1)[1]
    pytest_ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    durations = next(a for a in pytest_ini["addopts"] if a.startswith("--durations="))
    for quoted in (f"`tests/_timeouts.py`, {SAFETY_TIMEOUT_S} s", f"pytest-timeout's {pytest_ini['timeout']} s",
                   f"its {durations.split('=')[1]} slowest tests (`{durations}`"):
        assert quoted in section, f"docs/first_hour.md should say '{quoted}' (the value in the code)"
    named = re.findall(r"`(tests/[^`]+)`", section)
    assert named, "the section's table of slow tests names no test file: update this test"
    missing = [n for n in named if not list(ROOT.glob(n.rstrip("/")))]
    assert not missing, f"docs/first_hour.md names test files that do not exist: {missing}"
    readme = (ROOT / "README.md").read_text()
    typed = re.findall(r"(?<!-n )\b\d+ (?:minutes|tests|passed)\b",
                       section + readme.split("Run the test suite", 1)[1][:300])  # `-n 2 tests` is a flag
    assert not typed, f"a duration or test count typed by hand: {typed}; say `--durations` or `--collect-only`"


def test_the_readme_quotes_the_ci_time_budgets_as_set():
    """README.md's "How long" quotes .ci/run's budgets (settings, read here from where they are set; the measured
    figures live in tests/durations.json, written by CI, not typed into a page)."""
    import re

    script = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    for name in ("CORE_BUDGET_S", "TOTAL_BUDGET_S"):
        value = re.search(rf"^{name}=(\d+)$", script, re.M)
        assert value, f".ci/run no longer sets {name}: update README.md's 'How long' and this test"
        assert f"`{name}={value.group(1)}` seconds" in readme, f"README.md should quote `{name}={value.group(1)}`"
    tiers = json.loads((ROOT / "tests" / "durations.json").read_text())["tiers"]
    assert {"core", "slow", "contract"} <= set(tiers), sorted(tiers)


def test_the_readmes_first_python_block_runs_as_pasted():
    """The README's first python block defines every name it uses (issue 48: it used ``path``, set only by the
    hidden set-up before it, so that pasted it raised NameError); its hidden set-up does only what the text before
    it tells the reader to do (enable the simulated device: ``HF_TPU_SIMULATE=1``)."""
    import ast
    import builtins
    import re

    readme = (ROOT / "README.md").read_text()
    before, block = re.search(r"\A(.*?)```python\n(.*?)```", readme, re.S).groups()
    tree = ast.parse(block)
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
              for a in n.names}  # fmt: skip
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert not used - bound - set(dir(builtins)), f"the README's first block uses names it never sets: {used - bound}"
    hidden = re.findall(r"<!-- invisible-code-block: python\n(.*?)-->", before, re.S)
    code = [line.split("#")[0].strip() for setup in hidden for line in setup.splitlines()]
    assert [c for c in code if c] in ([], ["import hf_tpu.sim", "hf_tpu.sim.enable()"]), hidden
    assert "HF_TPU_SIMULATE=1" in before.split("-->")[-2 if hidden else -1]
