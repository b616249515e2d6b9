"""A serving compile cache is opened before anything runs on the chip: torch_tpu reads where its own caches live at
its first compile, and loading the model compiles (on a v5e, a server whose cache was opened at the warm-up compiled
every step graph again in the next process)."""

from __future__ import annotations

import hf_tpu
from hf_tpu import compile_cache
from hf_tpu.cli.main import main


def _recorded(monkeypatch) -> list:
    from hf_tpu.serving import _runner, server

    events = []
    opened = lambda self: events.append(("cache", self.root))  # noqa: E731
    monkeypatch.setattr(compile_cache.CompileCache, "_point_torch_tpu_here", opened)
    monkeypatch.setattr(hf_tpu, "enable", lambda *names: events.append(("enable",)))
    monkeypatch.setattr(server, "run_server", lambda model, **kwargs: events.append(("load", model)))
    monkeypatch.setattr(_runner, "_CACHES", {})
    for name in _runner.ServingSettings.__dataclass_fields__:  # put back after the test, whatever it configured
        monkeypatch.setattr(_runner.SETTINGS, name, getattr(_runner.SETTINGS, name))
    return events


def test_hf_tpu_serve_opens_the_compile_cache_before_the_integrations_and_the_model(tmp_path, monkeypatch):
    events = _recorded(monkeypatch)
    assert main(["serve", "--simulate", "--compile-cache", str(tmp_path / "cache"), "--no-warmup"]) == 0
    assert [e[0] for e in events] == ["cache", "enable", "load"], events
    assert events[0][1] == tmp_path / "cache"


def test_configure_opens_the_compile_cache_it_is_given_once(tmp_path, monkeypatch):
    from hf_tpu import serving

    events = _recorded(monkeypatch)
    serving.configure(compile_cache=str(tmp_path / "cache"))
    serving.configure(compile_cache=str(tmp_path / "cache"), slots=2)  # the same directory: the same cache
    serving.configure(compile_cache=False)  # none: nothing opened
    assert events == [("cache", tmp_path / "cache")]
