"""Check the paths a command was given before any library sees them, so that a mistake is one clear line.

Without this, ``transformers`` reads a missing directory as a Hub id (and fails with "Repo id must be in the
form..."), an empty directory as a tokenizer it cannot convert ("need sentencepiece or tiktoken"), and a Hub id on a
host with no network waits about a minute for connection retries. Here:

- an existing directory must hold ``config.json``, a weights file and tokenizer files (each missing one is named);
- a path that does not exist and cannot be a Hub id (``/abs``, ``./rel``, ``~``, more than one ``/``) is refused;
- a Hub-style id (``name`` or ``owner/name``) is used from the local Hub cache when it is there; otherwise it is
  refused at once under ``HF_HUB_OFFLINE=1``, or after a connection attempt of :data:`HUB_PROBE_SECONDS` to the
  Hub endpoint fails; when the Hub answers, transformers downloads it as usual;
- an output file (:func:`check_output_file`) must be writable before the work that produces it starts.

Example:
    >>> resolve_model_dir("/no/such/dir")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hf_tpu.errors.UserError: /no/such/dir: no such directory. ...
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from hf_tpu.errors import UserError

__all__ = ["HUB_PROBE_SECONDS", "ModelSource", "check_output_file", "hub_reachable", "resolve_model_dir"]

#: How long a Hub-style id waits for a TCP connection to the Hub endpoint before it is called unreachable.
HUB_PROBE_SECONDS = 3.0

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "tiktoken.model")


@dataclass(frozen=True)
class ModelSource:
    """What to pass to ``from_pretrained``: a local directory, or a Hub id (``local_files_only`` when only cached)."""

    path: str
    local_files_only: bool = False


def hub_reachable(seconds: float = HUB_PROBE_SECONDS) -> bool:
    """Whether a TCP connection to the Hub endpoint (``HF_ENDPOINT``) opens within ``seconds`` (DNS included)."""
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    result: list[bool] = []

    def probe() -> None:
        import socket

        try:
            socket.create_connection((host, port), timeout=seconds).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)  # getaddrinfo has no timeout of its own
    thread.start()
    thread.join(seconds)
    return bool(result and result[0])


def _check_model_dir(path: Path, tokenizer: bool = True) -> None:
    names = {p.name for p in path.iterdir()}
    missing = []
    if "config.json" not in names:
        missing.append("config.json")
    if not (names.intersection(_WEIGHTS) or any(n.endswith(".safetensors") for n in names)):
        missing.append("weights (model.safetensors)")
    if tokenizer and not names.intersection(_TOKENIZER):
        missing.append("tokenizer files (tokenizer.json)")
    if missing:
        found = ", ".join(sorted(names)[:6]) + (", ..." if len(names) > 6 else "") if names else "it is empty"
        raise UserError(
            f"{path} is not a saved model: {', '.join(missing)} not found there ({found}). Pass the directory that "
            f"model.save_pretrained(DIR){' and tokenizer.save_pretrained(DIR)' if tokenizer else ''} wrote, or a Hub id."
        )


def check_config(file: Path, transformers_reads: bool = True) -> None:
    """Refuse a ``config.json`` that is not a JSON object or (``transformers_reads``) that transformers cannot read,
    in one :class:`UserError` naming the file and the fix (instead of transformers' chained traceback)."""
    fix = "fix the file, or save the model again with model.save_pretrained(DIR)"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise UserError(f"{file} is not valid JSON ({str(exc)[:120]}): {fix}.") from None
    if not isinstance(data, dict):
        raise UserError(f"{file} must hold a JSON object of the model's configuration, not a {type(data).__name__}: "
                        f"{fix}.")  # fmt: skip
    if not transformers_reads:
        return
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(file.parent) if file.name == "config.json" else str(file))
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, KeyError, TypeError... on a bad config
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"{file}: transformers cannot read it ({type(exc).__name__}: {first}): {fix}.") from None


def _cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def resolve_model_dir(arg: str, tokenizer: bool = True) -> ModelSource:
    """Check ``arg`` (a directory or a Hub id) and say what is wrong in one :class:`UserError` message.

    ``tokenizer=False``: a model directory need not hold tokenizer files (``hf-tpu warmup`` runs no tokenizer).
    """
    path = Path(arg).expanduser()
    if path.is_dir():
        _check_model_dir(path, tokenizer)
        check_config(path / "config.json")
        return ModelSource(str(path))
    if path.exists():
        raise UserError(f"{arg} is a file, not a model directory: pass the directory that holds config.json.")
    if not _HUB_ID.match(arg) or arg.startswith((".", "~")):
        raise UserError(f"{arg}: no such directory. Pass a model directory (one saved with save_pretrained).")
    if _cached(arg):
        from huggingface_hub import constants

        return ModelSource(arg, local_files_only=bool(constants.HF_HUB_OFFLINE) or not hub_reachable())
    where = f"{arg} is not a local directory and not in the Hub cache"
    fix = f"download it where there is network (`hf download {arg} --local-dir DIR`) and pass DIR"
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise UserError(f"{where}, and HF_HUB_OFFLINE is set: {fix}, or unset HF_HUB_OFFLINE.")
    if not hub_reachable():
        raise UserError(f"{where}, and the Hub ({constants.ENDPOINT}) is not reachable from this host: {fix}.")
    return ModelSource(arg)


def check_output_file(path: str | None, flag: str) -> None:
    """Refuse an output path (``--out``, ``--report``, ``--json``) that cannot be written, before any work is done."""
    if path is None:
        return
    target = Path(path).expanduser()
    parent = target.parent
    if target.is_dir():
        raise UserError(f"{flag} {path}: that is a directory; give a file name, e.g. {target / 'out'}.")
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: the directory {parent} does not exist; create it first (mkdir -p {parent}).")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{flag} {path}: the directory {parent} is not writable.")
