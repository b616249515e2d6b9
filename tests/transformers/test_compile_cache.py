"""The persistent compile cache: a second process compiles nothing; bad entries are reported and bypassed.

The two-process test is the real thing (fresh processes, same cache directory); the in-process tests damage a
filled cache and check that generation still compiles what it needs and equals CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _timeouts import SAFETY_TIMEOUT_S

import hf_tpu
import hf_tpu.sim
from hf_tpu import compile_cache
from hf_tpu.compile_cache import CompileCache, CompileCacheWarning
from hf_tpu.transformers import generation

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_cache_worker.py")


def _save_llama(path: Path, seed: int) -> Path:
    import transformers as T

    from hf_tpu.testing import tiny_config

    torch.manual_seed(seed)
    T.AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=96)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _save_llama(tmp_path_factory.mktemp("cache-llama") / "llama", seed=0)


def _worker(model_dir: Path, cache_dir: Path, *flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TPU_SIMULATE", compile_cache.ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    # (prompts up to 16 tokens: the worker's generate, 13 tokens, takes bucket 16; the default 20 would warm up
    # bucket 32's two graphs too, compiled in the first process and loaded in each other one, used by neither)
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(model_dir), str(cache_dir), "--max-prompt-len=16", *flags], env=env,
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_nothing_and_matches_cpu(llama_dir, tmp_path):
    cache = tmp_path / "cache"
    # The first process built another family's model first (as a test worker or a server may have): process-wide
    # state such as transformers' output-capture registry differs from a fresh process's, and the graphs it saves
    # still load in one (issue #20: IndexError while the loader rebuilt their guards; hf_tpu._capture_registry).
    cold = _worker(llama_dir, cache, "--build-first=qwen3_moe")
    assert cold["equal"] and not cold["problems"]
    assert cold["warm_compiles"] == cold["graphs"] == cold["new_compiles"] > 0
    assert cold["warm_hits"] == cold["from_cache"] == 0

    warm = _worker(llama_dir, cache)
    assert warm["equal"] and not warm["problems"]
    assert warm["warm_compiles"] == warm["new_compiles"] == 0
    assert warm["warm_hits"] == warm["from_cache"] == warm["graphs"] == cold["graphs"]
    assert warm["generate_compiles"] == 0 and warm["generate_hits"] == 0  # warm-up loaded everything


@pytest.mark.slow
def test_graphs_that_leave_their_rows_to_the_loop_are_stored_and_loaded(llama_dir, tmp_path, monkeypatch):
    """``HF_TPU_KV_WRITE=after``: a decode graph whose rows the loop writes after it (its cache layers keep them as
    attributes, which dynamo sets after the graph) is stored by one process and loaded by the next, which compiles
    nothing and equals the CPU (hf_tpu/transformers/_cache/writes.py)."""
    monkeypatch.setenv("HF_TPU_KV_WRITE", "after")
    cold = _worker(llama_dir, tmp_path / "cache")
    assert cold["equal"] and not cold["problems"] and cold["new_compiles"] == cold["graphs"] > 0
    warm = _worker(llama_dir, tmp_path / "cache")
    assert warm["equal"] and not warm["problems"]
    assert warm["new_compiles"] == 0 and warm["from_cache"] == warm["graphs"] == cold["graphs"]


@pytest.mark.slow
def test_a_graph_switch_set_otherwise_loads_no_stored_graph(llama_dir, tmp_path, monkeypatch):
    """``HF_TPU_DECODE_ATTENTION`` picks the attention a decode graph computes (a graph switch of hf_tpu._env): a
    process with another value on the same cache directory compiles its own graphs, loading none of the first's,
    and both equal the CPU; a process with the first value again loads all of them (tests/test_env.py checks the
    key of every switch in one process)."""
    from hf_tpu import _env

    cache = tmp_path / "cache"
    monkeypatch.delenv(_env.DECODE_ATTENTION.name, raising=False)
    cold = _worker(llama_dir, cache)
    assert cold["equal"] and not cold["problems"] and cold["new_compiles"] == cold["graphs"] > 0
    monkeypatch.setenv(_env.DECODE_ATTENTION.name, _env.DECODE_ATTENTION.choices[1])
    other = _worker(llama_dir, cache)
    assert other["equal"] and not other["problems"]
    assert other["from_cache"] == 0 and other["new_compiles"] == other["graphs"] > 0
    monkeypatch.delenv(_env.DECODE_ATTENTION.name)
    again = _worker(llama_dir, cache)
    assert again["equal"] and again["new_compiles"] == 0 and again["from_cache"] == again["graphs"] == cold["graphs"]


def test_another_checkpoint_of_the_same_architecture_shares_the_entries(llama_dir, tmp_path):
    """Weights are graph inputs, not constants: a process with another checkpoint of the architecture loads the
    entries the first one stored. (The third process of the test above, a test of its own in the slow tier.)"""
    cache = tmp_path / "cache"
    cold = _worker(llama_dir, cache)
    assert cold["equal"] and not cold["problems"] and cold["warm_compiles"] == cold["graphs"] > 0
    other = _worker(_save_llama(tmp_path / "other", seed=1), cache)
    assert other["equal"] and other["warm_compiles"] == 0 and other["warm_hits"] == cold["graphs"]


PLAIN_IDENTITY = {
    "transformers", "model_class", "config", "attn_implementation", "dtype", "device", "float32_matmul_precision",
}


def test_a_float32_models_identity_holds_the_matmul_precision(llama_dir):
    """torch_tpu compiles float32 matmuls at the precision in force and the program keeps it (a v5e, run 18): a
    graph stored at 'medium' must not be loaded at 'highest'. A bfloat16 model's identity does not hold it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        medium = compile_cache.model_identity(model)
        torch.set_float32_matmul_precision("highest")
        highest = compile_cache.model_identity(model)
    finally:
        torch.set_float32_matmul_precision(before)
    assert (medium["float32_matmul_precision"], highest["float32_matmul_precision"]) == ("medium", "highest")
    assert {k: v for k, v in medium.items() if k != "float32_matmul_precision"} == {
        k: v for k, v in highest.items() if k != "float32_matmul_precision"
    }
    assert "float32_matmul_precision" not in compile_cache.model_identity(model.to(torch.bfloat16))


@pytest.fixture(scope="module")
def kv2_dir(tmp_path_factory):
    """8 heads over 2 KV heads and a vocabulary of 1001: at tp_size=4 the attention needs a KV-heads strategy and
    the vocabulary shards unevenly (the last rank's embedding rows differ), as in tests/distributed."""
    from hf_tpu.testing import tiny_model

    path = tmp_path_factory.mktemp("cache-tp") / "llama_kv2"
    tiny_model("llama", path, vocab_size=1001, num_attention_heads=8, hidden_size=64, intermediate_size=128)
    return path


def _tp_identity(path: Path, monkeypatch, *, rank: int, strategy: str) -> dict:
    """``model_identity`` of ``path`` loaded as rank ``rank`` of 4 with ``DistributedConfig(tp_size=4)`` and the
    given KV-heads strategy, as a launched rank would load it. A fake process group (torch's ``fake`` backend: no
    peers, collectives do nothing) stands in for the launch; loading reads only this rank's shards."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from hf_tpu.distributed.tp_plan import set_kv_heads_strategy

    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", 4)):
        monkeypatch.setenv(name, str(value))
    dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
    previous = set_kv_heads_strategy(strategy)
    try:
        with hf_tpu.enabled("tensor_parallel"):
            model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=4))
        return compile_cache.model_identity(model)
    finally:
        set_kv_heads_strategy(previous)
        dist.destroy_process_group()


def test_a_tensor_parallel_layout_rank_and_strategy_each_get_their_own_identity(kv2_dir, monkeypatch):
    """Launches sharing one cache: the config is the same for every layout and rank, so the namespace had nothing
    to tell them apart, and a second launch of 4 ranks ran another layout's (or rank's) graphs: wrong tokens with
    the "replicate" strategy. Each rank and layout now gets a namespace of its own; a model that is not split keeps
    the identity it always had (existing caches stay valid)."""
    from transformers import AutoModelForCausalLM

    rank0 = _tp_identity(kv2_dir, monkeypatch, rank=0, strategy="replicate")
    rank1 = _tp_identity(kv2_dir, monkeypatch, rank=1, strategy="replicate")
    rank3 = _tp_identity(kv2_dir, monkeypatch, rank=3, strategy="replicate")
    repeat = _tp_identity(kv2_dir, monkeypatch, rank=0, strategy="repeat")
    # (on the device the sharded loads chose: the simulated tpu when an earlier test enabled the simulator)
    plain = compile_cache.model_identity(AutoModelForCausalLM.from_pretrained(kv2_dir).to(rank0["device"]))
    assert set(plain) == PLAIN_IDENTITY  # no "parallel" part
    for tp in (rank0, rank1, rank3, repeat):
        assert {k: v for k, v in tp.items() if k != "parallel"} == plain  # the same model but for its layout
        assert tp["parallel"]["tp_size"] == 4
    layouts = [rank0["parallel"], rank1["parallel"], rank3["parallel"], repeat["parallel"]]
    assert [p["rank"] for p in layouts] == [0, 1, 3, 0]
    assert [p["kv_heads"] for p in layouts] == ["replicate"] * 3 + ["repeat"]
    assert all(p["meshes"] and p["meshes"][0]["ranks"] == [0, 1, 2, 3] for p in layouts)
    # ranks 0 and 1 hold shards of one shape (rank-dependent constants still differ: the rank tells them apart);
    # the last rank holds fewer vocabulary rows (1001 = 3 * 251 + 248); "repeat" keeps q/o sharded, k/v whole
    assert rank0["parallel"]["local_shapes"] == rank1["parallel"]["local_shapes"] != rank3["parallel"]["local_shapes"]
    assert repeat["parallel"]["local_shapes"] != rank0["parallel"]["local_shapes"]
    assert repeat["parallel"]["plan"] != rank0["parallel"]["plan"] == rank3["parallel"]["plan"]
    names = {json.dumps(tp, sort_keys=True) for tp in (plain, rank0, rank1, rank3, repeat)}
    assert len(names) == 5


def test_a_models_output_capture_classes_keep_their_positions_while_its_graph_compiles_or_loads():
    # transformers' registry of output-capturing classes is read by position in a saved graph (see
    # hf_tpu._capture_registry): while hf_tpu compiles or loads one, the model's classes come first, whatever the
    # process built before.
    from transformers import AutoModelForCausalLM
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY as registry

    from hf_tpu._capture_registry import stable_positions
    from hf_tpu.testing import tiny_config

    saved = list(dict.items(registry))
    dict.clear(registry)  # as in a fresh process (modeling_utils holds this very object)
    try:
        AutoModelForCausalLM.from_config(tiny_config("gpt2", vocab_size=96))  # built first, as in a busy process
        llama = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=96))
        before = list(registry.items())
        classes = [type(llama), type(llama.model)]
        assert [k for k, _ in before[2:]] == [str(c) for c in classes]
        with stable_positions([llama, "not a module"]):
            assert list(registry)[:2] == [str(c) for c in classes]
            assert dict(registry) == dict(before)
        assert list(registry.items()) == before
    finally:
        dict.clear(registry)
        dict.update(registry, saved)


def _fresh(path: Path):
    from transformers import AutoModelForCausalLM

    cpu = AutoModelForCausalLM.from_pretrained(path).eval()
    return cpu, AutoModelForCausalLM.from_pretrained(path).eval().to("tpu")


def _generate_both(cpu, tpu) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    return tpu.generate(ids, max_new_tokens=4), cpu.generate(ids, max_new_tokens=4)


@pytest.fixture(scope="module")
def filled(llama_dir, tmp_path_factory):
    """A cache directory holding the prefill and decode graphs of one shape (batch 1, prompt bucket 16)."""
    root = tmp_path_factory.mktemp("filled")
    hf_tpu.sim.enable()
    with hf_tpu.enabled("generation"):
        _, tpu = _fresh(llama_dir)
        hf_tpu.warmup(tpu, max_prompt_len=16, batch_sizes=[1], max_new_tokens=4, progress=False, cache_dir=root)
    return root


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _run_with(llama_dir, cache_dir, match: str | None):
    # Graphs dynamo already holds in this process (an earlier test in the worker generating with the same model
    # shapes) would serve the calls before the compile cache is asked: forget them, so the counts are the cache's.
    torch._dynamo.reset()
    hf_tpu.sim.enable()
    with hf_tpu.enabled("generation"):
        cpu, tpu = _fresh(llama_dir)
        generation.configure(tpu, compile_cache=cache_dir)
        with hf_tpu.sim.stats() as s:
            if match is None:
                got, expected = _generate_both(cpu, tpu)
            else:
                with pytest.warns(CompileCacheWarning, match=match):
                    got, expected = _generate_both(cpu, tpu)
    assert torch.equal(got, expected)
    return s


def test_a_filled_cache_serves_generate_in_process(llama_dir, filled, tmp_path):
    s = _run_with(llama_dir, _copy(filled, tmp_path / "c"), None)
    assert s.compiles == 0 and s.compile_cache_hits == 2


def test_a_corrupt_entry_is_reported_and_compiled_again(llama_dir, filled, tmp_path):
    cache = _copy(filled, tmp_path / "c")
    for graph in cache.rglob("*.bin"):
        graph.write_bytes(b"HF_TPU_GRAPH\n{not json")
    s = _run_with(llama_dir, cache, "is corrupt")
    assert s.compiles == 2 and s.compile_cache_hits == 0
    assert _run_with(llama_dir, cache, None).compile_cache_hits == 2  # rewritten, served again


def test_a_damaged_payload_is_reported_and_compiled_again(llama_dir, filled, tmp_path):
    cache = _copy(filled, tmp_path / "c")
    for graph in cache.rglob("*.bin"):
        data = graph.read_bytes()
        graph.write_bytes(data[: len(data) // 2])
    s = _run_with(llama_dir, cache, r"could not be loaded \(UnpicklingError: .*, raised in \w+ \(torch/")
    assert s.compiles == 2 and s.compile_cache_hits == 0


def test_an_entry_from_another_version_is_never_used(llama_dir, filled, tmp_path, monkeypatch):
    cache = _copy(filled, tmp_path / "c")
    # A graph file whose recorded key differs (copied from another version's namespace): reported, bypassed.
    for graph in cache.rglob("*.bin"):
        data = graph.read_bytes()
        graph.write_bytes(data.replace(b'\\"torch\\": \\"', b'\\"torch\\": \\"0.0-', 1))
    s = _run_with(llama_dir, cache, "stored for another model, version or graph")
    assert s.compiles == 2 and s.compile_cache_hits == 0
    # Another torch version in this process: another namespace, so nothing is loaded (and nothing is reported).
    real = compile_cache.versions
    monkeypatch.setattr(compile_cache, "versions", lambda: {**real(), "torch": "0.0-other"})
    s = _run_with(llama_dir, _copy(filled, tmp_path / "d"), None)
    assert s.compiles == 2 and s.compile_cache_hits == 0


def test_an_unusable_directory_is_reported_and_generation_still_works(llama_dir, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("a file where the cache directory should be")
    s = _run_with(llama_dir, not_a_dir, "cannot use")
    assert s.compiles == 2 and s.compile_cache_hits == 0


def test_the_environment_variable_names_the_default_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env-cache"))
    assert CompileCache.from_env().root == tmp_path / "env-cache"
    monkeypatch.setenv(compile_cache.ENV, "")
    assert CompileCache.from_env() is None
    with pytest.raises(TypeError, match="cache_dir must be a directory path"):
        CompileCache.coerce(3)


def test_clear_removes_the_entries(filled, tmp_path):
    cache = CompileCache(_copy(filled, tmp_path / "c"))
    assert list(cache.root.rglob("*.bin"))
    cache.clear()
    assert not list(cache.root.rglob("*.bin"))


def test_a_graph_stored_under_another_shape_fails_its_guards_and_is_compiled(llama_dir, filled, tmp_path):
    """Even an entry that passes the key checks (here: the 16-token prefill filed as the 32-token one) never runs on
    inputs it was not traced for: its saved guards reject them, and the graph is compiled instead."""
    from hf_tpu.transformers import _graphs

    cache = _copy(filled, tmp_path / "c")
    (space,) = (cache / "hf_tpu-v1").glob("generation-*")
    have, want = (_graphs._graph_id(("prefill", 1, p, c), (None,)) for p, c in ((16, 32), (32, 64)))
    source = space / "graphs" / f"{compile_cache._sha(have)[:32]}.bin"
    data = source.read_bytes().replace(json.dumps(have).encode()[1:-1], json.dumps(want).encode()[1:-1], 1)
    (space / "graphs" / f"{compile_cache._sha(want)[:32]}.bin").write_bytes(data)

    hf_tpu.sim.enable()
    with hf_tpu.enabled("generation"):
        cpu, tpu = _fresh(llama_dir)
        generation.configure(tpu, compile_cache=cache)
        ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(4))
        with hf_tpu.sim.stats() as s, pytest.warns(CompileCacheWarning, match="does not fit these inputs"):
            got = tpu.generate(ids, max_new_tokens=4)
    assert torch.equal(got, cpu.generate(ids, max_new_tokens=4))
    assert ("prefill", 1, 32, 64) in generation.compiled_graphs(tpu)
    assert s.compiles == 2  # the rejected prefill, and the decode graph no process stored
    assert s.compile_cache_hits == 0  # a graph its guards reject served nothing


_RECORDER = """
import sys
from hf_tpu.compile_cache import CompileCache
space = CompileCache(sys.argv[1]).namespace("test", {"model": "shared"})
for i in range(40):
    space.record([[sys.argv[2], i]])
print(space.manifest_path)
"""


def test_processes_recording_at_once_lose_no_manifest_entry(tmp_path):
    """Ranks or parallel warm-ups writing one manifest at once: every entry of every process is kept."""
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _RECORDER, str(tmp_path), f"p{n}"], env={**os.environ}, stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(4)
    ]  # fmt: skip
    try:
        outs = [w.communicate(timeout=SAFETY_TIMEOUT_S)[0] for w in writers]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
    assert [w.returncode for w in writers] == [0, 0, 0, 0]
    (manifest,) = {out.strip() for out in outs}  # one namespace, written by all four
    entries = json.loads(Path(manifest).read_text())["entries"]
    assert sorted(map(tuple, entries)) == sorted((f"p{n}", i) for n in range(4) for i in range(40))
