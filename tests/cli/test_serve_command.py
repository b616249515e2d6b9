"""``hf-tpu serve --compile-cache DIR`` opens the cache before anything runs on the chip: torch_tpu reads where its own
caches live at its first compile, and loading the model compiles (on a v5e, a server whose cache was opened at the
warm-up compiled every step graph again in the next process)."""

from __future__ import annotations

import hf_tpu
from hf_tpu import compile_cache
from hf_tpu.cli.main import main


def test_the_compile_cache_is_opened_before_the_integrations_and_the_model(tmp_path, monkeypatch):
    from hf_tpu.serving import _runner, server

    events = []
    opened = lambda self: events.append(("cache", self.root))  # noqa: E731
    monkeypatch.setattr(compile_cache.CompileCache, "_point_torch_tpu_here", opened)
    monkeypatch.setattr(hf_tpu, "enable", lambda *names: events.append(("enable",)))
    monkeypatch.setattr(server, "run_server", lambda model, **kwargs: events.append(("load", model)))
    monkeypatch.setattr(_runner, "_CACHES", {})
    saved = dict(vars(_runner.SETTINGS))
    try:
        assert main(["serve", "--simulate", "--compile-cache", str(tmp_path / "cache"), "--no-warmup"]) == 0
    finally:
        _runner.SETTINGS.__dict__.update(saved)
    assert [e[0] for e in events] == ["cache", "enable", "load"], events
    assert events[0][1] == tmp_path / "cache"
