"""Name the weights file behind a safetensors error, and say how to fix it.

safetensors reports a truncated or corrupt file as ``SafetensorError: Error while deserializing header: incomplete
metadata, file not fully covered``, without the file's path; with a sharded checkpoint the user cannot tell which
shard is broken. :func:`bad_safetensors_files` reads only each file's header (8 bytes of length, the JSON header)
and compares the tensors' extent with the file's size; :func:`checkpoint_error` turns a safetensors error raised
while loading ``path`` into a :class:`hf_tpu.errors.CheckpointFileError` naming those files and the fix.

Example:
    >>> bad_safetensors_files("/no/such/dir")
    []
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from hf_tpu.errors import CheckpointFileError

__all__ = ["bad_safetensors_files", "checkpoint_error", "is_safetensors_error", "safetensors_problem"]


def safetensors_problem(file: str | os.PathLike) -> str | None:
    """What is wrong with one ``.safetensors`` file (None when its header is whole and covers the file)."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than the 8-byte header length"
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return f"the header says {length} bytes of metadata but the file is {size} bytes (truncated)"
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return "its metadata is not valid JSON (corrupt)"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    expected = 8 + length + max(ends, default=0)
    if expected != size:
        return f"{size} bytes where its header describes {expected} ({'truncated' if size < expected else 'corrupt'})"
    return None


def bad_safetensors_files(path: str | os.PathLike) -> list[tuple[Path, str]]:
    """``(file, problem)`` for every broken ``.safetensors`` file in directory ``path`` (or ``path`` itself)."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors")) if p.is_dir() else []
    found = []
    for file in files:
        problem = safetensors_problem(file)
        if problem:
            found.append((file, problem))
    return found


def is_safetensors_error(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is safetensors' own error."""
    while err is not None:
        if type(err).__name__ == "SafetensorError" or "deserializing header" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def checkpoint_error(path: str | os.PathLike, err: BaseException) -> CheckpointFileError | None:
    """A :class:`CheckpointFileError` naming the broken files under ``path``, or None when none is found there."""
    if not is_safetensors_error(err):
        return None
    bad = bad_safetensors_files(path)
    if not bad:
        return None
    files = "; ".join(f"{file} is {problem}" for file, problem in bad)
    return CheckpointFileError(
        f"cannot read the weights: {files}. Download it again (an interrupted download leaves a short file), or "
        f"save it again with save_pretrained. (safetensors said: {err})"
    )
