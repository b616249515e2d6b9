"""The environment table, hf_tpu._env (issue #66): each graph switch changes the compile cache's key, nothing else
does, values are parsed at each read, and docs/environment.md is the table's own output.

Reads anywhere but the table are refused by tests/test_house.py (rule 7).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu import _env
from hf_tpu.compile_cache import CompileCache
from hf_tpu.errors import HfTpuValueError, InvalidArgumentError

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "environment.md"
MARK = "<!-- the table below is `python -m hf_tpu._env`'s output -->\n"
GRAPH_SWITCHES = sorted(name for name, var in _env.VARS.items() if var.graph)
PARTS = {"model_class": "Example", "ladder": [16, 32]}  # a namespace's own parts, as generation's are


@pytest.fixture
def clean_env(monkeypatch):
    """No HF_TPU_* graph switch set (the suite sets HF_TPU_SIM_MATMUL_PRECISION for every process)."""
    for name in GRAPH_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _entries(cache_dir: Path, env: dict[str, str], monkeypatch) -> tuple[str, list]:
    """A new CompileCache over ``cache_dir`` (as a new process makes one) under ``env``: its namespace's folder and
    the entries recorded there so far."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    space = CompileCache(cache_dir).namespace("generation", PARTS)
    assert space is not None
    return space.path.name, space.manifest()


def test_the_table_has_graph_switches_and_each_takes_several_words():
    assert {"HF_TPU_KV_WRITE", "HF_TPU_DECODE_ATTENTION", "HF_TPU_MEASURED_EXPERTS"} <= set(GRAPH_SWITCHES)
    for name in GRAPH_SWITCHES:  # (the key test below needs two values other than the default)
        assert len(_env.VARS[name].choices) >= 3, name


@pytest.mark.parametrize("name", GRAPH_SWITCHES)
def test_each_graph_switch_changes_the_compile_cache_key(name, tmp_path, clean_env):
    """One cache directory, two values: the second never sees the first's entries; the same value again does (a
    new CompileCache each time, as in a new process). Unset and the default are one key, the key made before the
    table existed."""
    var = _env.VARS[name]
    default, first, second = var.choices[0], var.choices[1], var.choices[2]
    cache = tmp_path / "cache"
    folder_a, entries = _entries(cache, {name: first}, clean_env)
    assert entries == []
    CompileCache(cache).namespace("generation", PARTS).record([["decode", 1, 32]])
    assert _entries(cache, {name: first}, clean_env) == (folder_a, [["decode", 1, 32]])
    folder_b, entries = _entries(cache, {name: second}, clean_env)
    assert folder_b != folder_a and entries == []
    folder_default, _ = _entries(cache, {name: default}, clean_env)
    clean_env.delenv(name)
    folder_unset, _ = _entries(cache, {}, clean_env)
    assert folder_default == folder_unset and folder_default not in (folder_a, folder_b)
    assert _env.graph_key() == {}
    clean_env.setenv(name, f" {first.upper()} ")  # the value parsed, not the text
    assert _env.graph_key() == {name: first}
    assert _entries(cache, {}, clean_env)[0] == folder_a


def test_other_variables_leave_the_key_alone(tmp_path, clean_env):
    folder, _ = _entries(tmp_path, {}, clean_env)
    for name, var in _env.VARS.items():
        if not var.graph and name != "HF_TPU_COMPILE_CACHE":
            clean_env.setenv(name, var.choices[1] if var.choices else "2")
    assert _entries(tmp_path, {}, clean_env)[0] == folder


def test_a_refused_value_is_in_the_key_as_written_and_refused_where_it_is_read(clean_env):
    """A key never raises: the code that reads the switch refuses the value with its own message."""
    clean_env.setenv("HF_TPU_KV_WRITE", "later")
    assert _env.graph_key() == {"HF_TPU_KV_WRITE": "later"}
    with pytest.raises(InvalidArgumentError, match="HF_TPU_KV_WRITE='later' is not a KV write mode.*auto, graph"):
        _env.KV_WRITE.get()


def test_values_are_read_at_each_call(monkeypatch):
    monkeypatch.delenv("HF_TPU_DEBUG", raising=False)
    assert _env.DEBUG.get() is False
    monkeypatch.setenv("HF_TPU_DEBUG", " Yes ")
    assert _env.DEBUG.get() is True
    monkeypatch.setenv("HF_TPU_STRICT_COMPILE", "eager")
    assert _env.STRICT_COMPILE.get() == "eager"
    monkeypatch.setenv("HF_TPU_SIM_DEVICES", "8")
    assert _env.SIM_DEVICES.get() == 8
    monkeypatch.setenv("HF_TPU_SIM_DEVICES", "0")
    with pytest.raises(ValueError, match="HF_TPU_SIM_DEVICES='0'"):
        _env.SIM_DEVICES.get()
    monkeypatch.setenv("HF_TPU_SIM_NATIVE", "off")
    assert _env.SIM_NATIVE.get() is False
    monkeypatch.setenv("HF_TPU_COMPILE_CACHE", "  ")
    assert _env.COMPILE_CACHE.get() is None and not _env.COMPILE_CACHE.is_set()


def test_a_variable_is_registered_once_and_only_an_hf_tpu_one():
    with pytest.raises(HfTpuValueError, match="registered twice"):
        _env._register(_env.Var("HF_TPU_DEBUG", str, None, "", ""))
    with pytest.raises(HfTpuValueError, match="HF_TPU_"):
        _env._register(_env.Var("TPU_NAME", str, None, "", ""))


def test_the_docs_page_is_the_tables_output():
    page = DOCS.read_text()
    assert MARK in page, f"{DOCS} lost its marker line: {MARK!r}"
    shown = page.split(MARK, 1)[1]
    printed = subprocess.run(
        [sys.executable, "-m", "hf_tpu._env"], cwd=REPO, capture_output=True, text=True, check=True,
        timeout=SAFETY_TIMEOUT_S,
    ).stdout  # fmt: skip
    assert shown == printed == _env.markdown(), (
        "docs/environment.md's table differs from hf_tpu/_env.py: regenerate it (python -m hf_tpu._env)"
    )
    for name in _env.VARS:
        assert f"`{name}`" in shown
