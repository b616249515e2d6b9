"""hf_tpu.ray.serve's arguments: Ray's TPU counts, tp within a replica's chips, the builder's keys (no cluster)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from hf_tpu.errors import UserError  # noqa: E402
from hf_tpu.ray import serve as ray_serve  # noqa: E402


def test_chips_per_replica_must_be_a_count_ray_schedules():
    with pytest.raises(UserError, match="chips_per_replica=3: Ray schedules 1, 2, 4 or 8"):
        ray_serve.build_app(chips_per_replica=3)


def test_tp_needs_as_many_chips_per_replica():
    with pytest.raises(UserError, match="tp=4 needs 4 chips.*chips_per_replica=4"):
        ray_serve.build_app(chips_per_replica=2, tp=4)


def test_the_builder_takes_serve_runs_arguments_and_names_unknown_ones():
    with pytest.raises(UserError, match="unknown argument\\(s\\) replicas; known: chips_per_replica, model"):
        ray_serve.app({"replicas": "2"})
    app = ray_serve.app({"model": "/m", "num_replicas": "2", "chips_per_replica": "4", "tp": "4",
                         "serve_args": "--slots 8 --compile-cache /mnt/c", "simulate": "true"})  # fmt: skip
    deployment = app._bound_deployment
    assert deployment.num_replicas == 2
    assert deployment.ray_actor_options["resources"] == {"TPU": 4}
    assert app._bound_deployment.init_args == ("/m", ["--slots", "8", "--compile-cache", "/mnt/c"], 4, True, 1800.0)


def test_replicas_find_the_compile_cache_they_share_from_the_flag_or_the_environment(monkeypatch):
    from hf_tpu.compile_cache import ENV

    app = ray_serve.build_app(serve_args=["--slots", "8"], compile_cache="/mnt/c")
    assert app._bound_deployment.init_args[1] == ["--slots", "8", "--compile-cache", "/mnt/c"]
    monkeypatch.delenv(ENV, raising=False)
    assert ray_serve._compile_cache_dir(["--slots", "8"]) is None  # no cache: replicas start at once, no lock
    assert ray_serve._compile_cache_dir(["--compile-cache", "/a", "--compile-cache=/b"]) == "/b"  # argparse's: last
    monkeypatch.setenv(ENV, "/env")
    assert ray_serve._compile_cache_dir(["--slots", "8"]) == "/env"
    assert ray_serve._compile_cache_dir(["--compile-cache", "/a"]) == "/a"
