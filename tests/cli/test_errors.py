"""A user mistake gets a few lines naming the path and what is missing, never a traceback; --debug shows it.

Each case checks the exit status, the number of lines, the named path and the absence of a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from _timeouts import SAFETY_TIMEOUT_S

import hf_tpu
from hf_tpu._patch import INTEGRATIONS
from hf_tpu.assets import default_model_path
from hf_tpu.cli import _model_path
from hf_tpu.errors import CheckpointFileError, UserError

cli_main = importlib.import_module("hf_tpu.cli.main")  # hf_tpu.cli.main the module (the package exports main())
REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 3  # the message (one line, however long) and the --debug hint


def short_error(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) <= MAX_LINES, err
    assert "Traceback" not in err and 'File "' not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert "--debug" in lines[-1] and "HF_TPU_DEBUG=1" in lines[-1]


@pytest.fixture
def truncated_model(tmp_path) -> Path:
    """The shipped model with its weights file cut short, as an interrupted download leaves it."""
    path = tmp_path / "truncated"
    shutil.copytree(default_model_path(), path)
    weights = path / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 3)
    return path


def test_generate_a_missing_directory(tmp_path, capsys):
    missing = str(tmp_path / "no" / "such" / "dir")
    assert cli_main.main(["generate", "--simulate", missing]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    short_error(err, f"hf-tpu generate: {missing}: no such directory")


def test_generate_an_empty_directory_names_what_is_missing(tmp_path, capsys):
    assert cli_main.main(["generate", "--simulate", "--model", str(tmp_path)]) == 2
    short_error(capsys.readouterr().err, str(tmp_path), "config.json", "weights", "tokenizer", "it is empty")


def test_generate_a_file_instead_of_a_directory(tmp_path, capsys):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    assert cli_main.main(["generate", "--simulate", str(file)]) == 2
    short_error(capsys.readouterr().err, f"{file} is a file, not a model directory")


def test_generate_a_hub_id_under_hf_hub_offline(monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert cli_main.main(["generate", "--simulate", "hf-tpu-tests/not-a-model"]) == 2
    short_error(
        capsys.readouterr().err,
        "hf-tpu-tests/not-a-model is not a local directory and not in the Hub cache",
        "HF_HUB_OFFLINE is set",
        "hf download hf-tpu-tests/not-a-model --local-dir DIR",
    )


def test_generate_a_hub_id_with_the_hub_unreachable(monkeypatch, capsys):
    """HF_HUB_OFFLINE unset and no network: refused after one connection attempt, not a minute of retries."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    probes = []
    real = _model_path.hub_reachable
    monkeypatch.setattr(_model_path, "hub_reachable", lambda *a: probes.append(a) or real(*a))
    assert cli_main.main(["generate", "--simulate", "hf-tpu-tests/not-a-model"]) == 2
    short_error(capsys.readouterr().err, "not a local directory", "the Hub (http://127.0.0.1:9) is not reachable")
    assert probes == [()]  # one probe, bounded by HUB_PROBE_SECONDS


def test_the_hub_probe_gives_up_after_its_bound(monkeypatch):
    """A connection that never answers (DNS or TCP hanging) is reported unreachable once the bound has passed."""
    import socket

    release = threading.Event()

    def hang(*args, **kwargs):
        release.wait()
        raise OSError("released")

    monkeypatch.setattr(socket, "create_connection", hang)
    try:
        assert _model_path.hub_reachable(0.05) is False
    finally:
        release.set()


def test_generate_a_truncated_weights_file_names_it(truncated_model, capsys):
    assert cli_main.main(["generate", "--simulate", str(truncated_model), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    err = err[err.index("hf-tpu generate:") :]  # after the loading bar
    short_error(err, f"{truncated_model / 'model.safetensors'} is ", "(truncated)", "Download it again")


def test_debug_flag_and_environment_show_the_traceback(tmp_path, monkeypatch):
    missing = str(tmp_path / "missing")
    with pytest.raises(UserError, match="no such directory"):
        cli_main.main(["generate", "--simulate", missing, "--debug"])
    with pytest.raises(UserError, match="no such directory"):
        cli_main.main(["--debug", "generate", "--simulate", missing])
    monkeypatch.setenv(cli_main.DEBUG_ENV, "1")
    with pytest.raises(UserError, match="no such directory"):
        cli_main.main(["generate", "--simulate", missing])


@pytest.mark.parametrize("command", list(cli_main.COMMANDS))
def test_every_command_prints_user_errors_without_a_traceback(command, monkeypatch, capsys):
    """The handler is central: whatever command raises a UserError (or a file error) gets the short form."""

    class Fake:
        @staticmethod
        def register(subparsers):
            return subparsers.add_parser(command)

        @staticmethod
        def run(args: argparse.Namespace) -> int:
            raise CheckpointFileError(f"/data/{command}/model.safetensors is truncated: download it again")

    monkeypatch.setattr(cli_main, "_load", lambda name: Fake)
    assert cli_main.main([command]) == 2
    short_error(capsys.readouterr().err, f"hf-tpu {command}: /data/{command}/model.safetensors is truncated")


def test_a_bug_keeps_its_traceback(monkeypatch):
    class Fake:
        register = staticmethod(lambda subparsers: subparsers.add_parser("env"))

        @staticmethod
        def run(args):
            raise KeyError("a bug, not a user mistake")

    monkeypatch.setattr(cli_main, "_load", lambda name: Fake)
    with pytest.raises(KeyError):
        cli_main.main(["env"])


def test_diffuse_a_missing_directory(tmp_path, capsys):
    missing = str(tmp_path / "sd3")
    argv = ["diffuse", missing, "--prompt", "x", "--out", str(tmp_path / "i.png"), "--simulate"]
    assert cli_main.main(argv) == 2
    short_error(capsys.readouterr().err, f"hf-tpu diffuse: {missing}: no such directory")
    assert not (tmp_path / "i.png").exists()


def test_the_console_command_end_to_end(tmp_path):
    """As a new user types it: a separate process, its whole stderr."""
    env = {k: v for k, v in os.environ.items() if k != "HF_TPU_SIMULATE"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    missing = str(tmp_path / "no-such-dir")
    proc = subprocess.run(
        [sys.executable, "-m", "hf_tpu.cli", "generate", "--simulate", missing],
        env=env, capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    short_error(proc.stderr, missing, "no such directory")


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["diffuse", "--simulate", "--prompt", "x", "--out"], "--out"),
        (["--simulate", "selftest", "--only", "runtime", "--report"], "--report"),
        (["bench", "sim_forward", "--json"], "--json"),
    ],
)
def test_an_output_file_that_cannot_be_written_is_refused_before_the_work(argv, flag, tmp_path, capsys, monkeypatch):
    missing_dir = tmp_path / "no-such-dir"
    started = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: started.append(a))  # bench's benchmark process
    assert cli_main.main([*argv, str(missing_dir / "out.file")]) == 2
    short_error(capsys.readouterr().err, f"{flag} {missing_dir / 'out.file'}: the directory {missing_dir} does not")
    assert not started and not missing_dir.exists()
    assert cli_main.main([*argv, str(tmp_path)]) == 2  # a directory where a file is wanted
    short_error(capsys.readouterr().err, f"{flag} {tmp_path}: that is a directory")


def test_a_file_error_with_a_path_is_short_too(monkeypatch, capsys):
    class Fake:
        register = staticmethod(lambda subparsers: subparsers.add_parser("env"))

        @staticmethod
        def run(args):
            with open("/no/such/dir/report.json", "w") as f:
                f.write("{}")

    monkeypatch.setattr(cli_main, "_load", lambda name: Fake)
    assert cli_main.main(["env"]) == 2
    short_error(capsys.readouterr().err, "No such file or directory: '/no/such/dir/report.json'")


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    # `hf-tpu env --json | head`: the command's output meets a closed pipe; it ends with status 0, no traceback
    code = (
        "import sys\n"
        "import hf_tpu.cli.env as env\n"
        "def closed(args):\n"
        "    raise BrokenPipeError(32, 'Broken pipe')\n"
        "env.run = closed\n"
        "from hf_tpu.cli.main import main\n"
        "sys.exit(main(['env']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def enabled_integrations() -> set[str]:
    return {name for name in INTEGRATIONS if hf_tpu.is_enabled(name)}


def test_generate_called_in_a_process_leaves_its_integrations_as_they_were(truncated_model, capsys):
    """``generate`` enables the ``generation`` integration (before it reads the weights): main() reverts it."""
    before = enabled_integrations()
    assert cli_main.main(["generate", "--simulate", str(truncated_model), "--max-new-tokens", "2"]) == 2
    assert enabled_integrations() == before


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_main_reverts_what_a_command_enabled_and_keeps_what_the_caller_had(fails, monkeypatch, capsys):
    during = set()

    class Fake:
        register = staticmethod(lambda subparsers: subparsers.add_parser("serve"))

        @staticmethod
        def run(args):
            hf_tpu.enable()  # as `serve` does: every integration
            during.update(enabled_integrations())
            if fails:
                raise UserError("a mistake of the user's")
            return 0

    monkeypatch.setattr(cli_main, "_load", lambda name: Fake)
    with hf_tpu.enabled("kernels"):  # the caller's own
        before = enabled_integrations()
        assert cli_main.main(["serve"]) == (2 if fails else 0)
        assert before < during, "nothing for main() to revert: another test left every integration enabled"
        assert enabled_integrations() == before
