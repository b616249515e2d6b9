"""The lowering process: ``python -m hf_tpu.tpu_compile._child SPEC.json OUT.json``.

It starts torch_tpu's device on this host with the stand-ins of :func:`hf_tpu._torch_tpu.start_lowering`, calls the
entry named in the spec (``"module:function"``, with the spec's ``kwargs`` and the lowering session), and writes
every program torch_tpu lowered, with the entry's labels and facts, to OUT.json. A failure is written there too:
its message, and the innermost line of user code (not torch's, not torch_tpu's) it came from.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback

PROGRESS_PREFIX = "hf_tpu.tpu_compile:"  # the parent forwards the lines that start with it
_LIBRARY_DIRS = ("/torch/", "/torch_tpu/", "/transformers/", "/diffusers/", "/accelerate/", "/torchao/", "/hf_tpu/")


def _where(exc: BaseException) -> str | None:
    """The innermost frame of ``exc`` outside the libraries (else the innermost one), as ``file:line `code```."""
    frames = traceback.extract_tb(exc.__traceback__)
    chosen = None
    for frame in frames:
        if not any(d in frame.filename for d in _LIBRARY_DIRS):
            chosen = frame
    chosen = chosen or (frames[-1] if frames else None)
    if chosen is None:
        return None
    return f"{chosen.filename}:{chosen.lineno} `{(chosen.line or '').strip()}`"


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines[:6])


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    from hf_tpu import _torch_tpu

    started = time.perf_counter()
    result: dict = {"programs": [], "labels": [], "info": {}, "error": None, "where": None}
    session = None
    try:
        session = _torch_tpu.start_lowering(announce=lambda m: print(f"{PROGRESS_PREFIX} {m}", flush=True))
        result["init_seconds"] = time.perf_counter() - started
        module_name, func_name = spec["entry"].split(":")
        entry = getattr(importlib.import_module(module_name), func_name)
        session.mark()
        info = entry(session, **spec.get("kwargs", {})) or {}
        result["labels"] = list(info.pop("labels", []))
        result["info"] = info
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent, with where it came from
        result["error"] = _error(exc)
        result["where"] = _where(exc)
        result["traceback"] = traceback.format_exc()[-6000:]
    if session is not None:
        result["programs"] = [p.to_dict() for p in session.programs]
        result["eager"] = dict(session.counts)
    result["seconds"] = time.perf_counter() - started
    text = json.dumps(result, default=str)  # a fact the entry returned that JSON cannot hold is kept as text
    with open(out_path, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
