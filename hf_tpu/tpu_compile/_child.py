"""The lowering process: ``python -m hf_tpu.tpu_compile._child SPEC.json OUT.json``.

It starts torch_tpu's device on this host with the stand-ins of :func:`hf_tpu._torch_tpu.start_lowering`, calls the
entry named in the spec (``"module:function"``, with the spec's ``kwargs`` and the lowering session), and writes
every program torch_tpu lowered, with the entry's labels and facts, to OUT.json. A failure is written there too:
its message, and the innermost line of user code (not torch's, not torch_tpu's) it came from. :func:`lower_each` is
the entry that runs several entries in this one process (:func:`hf_tpu.tpu_compile.lower_and_compile_each`).
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


def lower_each(session, entries: dict[str, dict]) -> dict:
    """Several entries in one lowering process (one torch_tpu device start instead of one each): ``entries`` maps a
    name to ``{"entry": "module:function", "kwargs": {...}}``. Each runs as :func:`main` runs one (``session.mark()``
    first), after ``torch._dynamo.reset()`` so that no compiled code or guard of an earlier entry is reused; an entry
    that raises is recorded (its error and where it came from) and the next one runs. Returns one label per program
    (the entry's own, else ``<name>/graph-<i>``) and ``groups``: per entry, its programs' slice (``first``,
    ``count``), its labels, info, error, where and the eager traffic it alone caused."""
    import torch

    labels: list[str] = []
    groups = []
    for name, spec in entries.items():
        module_name, func_name = spec["entry"].split(":")
        entry = getattr(importlib.import_module(module_name), func_name)
        torch._dynamo.reset()
        first, before = len(session.programs), dict(session.counts)
        group = {"name": name, "first": first, "labels": [], "info": {}, "error": None, "where": None}
        session.mark()
        try:
            info = dict(entry(session, **spec.get("kwargs", {})) or {})
            group["labels"] = list(info.pop("labels", []))
            group["info"] = info
        except Exception as exc:  # noqa: BLE001 - recorded for that entry; the next entry still runs
            group["error"], group["where"] = f"{type(exc).__name__}: {exc}", _where(exc)
        group["count"] = len(session.programs) - first
        group["eager"] = {k: v - before.get(k, 0) for k, v in session.counts.items()}
        own = group["labels"] if len(group["labels"]) == group["count"] else []
        labels += own or [f"{name}/graph-{i}" for i in range(group["count"])]
        groups.append(group)
    return {"labels": labels, "groups": groups}


def _scan_pci_once() -> None:
    """torch_tpu's PCI scan (``hardware._scan_pci_tpus``: a read of each device's sysfs files) answered once for
    this process. With the device started by the stand-in, not by a chip, ``torch.tpu.is_available()`` scans the
    bus on every call (its count is cached only once the runtime is up), and FakeTensor asks it for every fake
    tensor it makes: some 18,000 scans in the compile tier's lowering, 1.5 s of CPU. The bus does not change while
    this process lowers."""
    import functools

    from torch_tpu._internal.utils import hardware

    from hf_tpu import _patch

    _patch.assign(hardware, "_scan_pci_tpus", functools.cache(hardware._scan_pci_tpus), feature="tpu_compile",
                  reason="for the life of a lowering process, which exits when its entries are lowered")  # fmt: skip


def main(argv: list[str]) -> int:
    import gc

    # A batch process whose time goes to tracing graphs (dynamo and torch_tpu's front end allocate millions of
    # short-lived objects) and which exits when they are lowered: the young generation is collected every 50,000
    # allocations instead of 700, and what torch and torch_tpu's start left (never freed before the exit) is frozen,
    # so that the collector's full passes stop walking it; frozen again at the end, the exit walks nothing.
    gc.set_threshold(50_000, 20, 10)
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    from hf_tpu import _torch_tpu

    started = time.perf_counter()
    result: dict = {"programs": [], "labels": [], "info": {}, "error": None, "where": None}
    session = None
    try:
        session = _torch_tpu.start_lowering(announce=lambda m: print(f"{PROGRESS_PREFIX} {m}", flush=True))
        _scan_pci_once()
        gc.freeze()
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
    gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
