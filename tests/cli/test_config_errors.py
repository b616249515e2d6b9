"""A user's mistake answered in a few lines, exit status 2, before any model loads: an invalid ``config.json``
(``generate``, ``serve``, ``plan``), ``serve --port 99999``, a ``--host`` not on this machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu.assets import default_model_path

ROOT = Path(__file__).resolve().parents[2]


def hf_tpu(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hf_tpu.cli", *args], capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S,
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip


def _broken(tmp_path: Path, text: str) -> Path:
    model = tmp_path / "model"
    shutil.copytree(default_model_path(), model)
    (model / "config.json").write_text(text)
    return model


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> Path:
    return _broken(tmp_path_factory.mktemp("broken"), '{"model_type": "llama", "hidden_size": ')


@pytest.mark.parametrize(("text", "said"), [('{"model_type": "nosuch"}', "transformers cannot read it (ValueError"),
                                            ("[1, 2]", "must hold a JSON object"), ("{", "is not valid JSON")])
def test_check_config_names_the_file_and_the_fix_in_one_line(tmp_path, text, said):
    from hf_tpu.cli._model_path import check_config
    from hf_tpu.errors import UserError

    config = _broken(tmp_path, text) / "config.json"
    with pytest.raises(UserError) as info:
        check_config(config)
    [line] = str(info.value).splitlines()
    assert line.startswith(str(config)) and said in line and "save_pretrained" in line
    check_config(default_model_path() / "config.json")  # the shipped model's passes


@pytest.mark.parametrize("command", [["generate", "--simulate", "--prompt", "hi"], ["serve", "--simulate"], ["plan"]])
def test_an_invalid_config_json_is_named_in_a_few_lines_with_exit_2(broken, command):
    proc = hf_tpu(command[0], str(broken), *command[1:])
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert len(lines) <= 5 and "Traceback" not in proc.stderr, lines
    assert str(broken / "config.json") in lines[0] and "save_pretrained" in lines[0]
    assert "listening" not in proc.stdout and "loading" not in proc.stdout


def test_serve_refuses_a_port_out_of_range_before_loading_the_model():
    proc = hf_tpu("serve", "--simulate", "--port", "99999")
    assert proc.returncode == 2 and proc.stdout == ""  # nothing loaded: not even "loading ..."
    [line] = proc.stderr.strip().splitlines()
    assert "--port 99999" in line and "65535" in line


def test_serve_says_a_host_is_not_on_this_machine():
    proc = hf_tpu("serve", "--simulate", "--host", "192.0.2.1", "--port", "8123")  # TEST-NET-1: never local
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert "--host 192.0.2.1 is not an address of this machine" in line and "taken" not in line
