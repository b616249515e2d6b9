"""FSDP2 through the Trainer on launched TPU ranks (``hf-tpu launch --simulate``, one simulated chip per rank).

A tiny Llama and a tiny Mixtral (MoE) trained with ``Trainer(fsdp="full_shard", fsdp_config={"fsdp_version": 2})``
on N ranks give the losses, step by step, of one process training the same model on the whole global batch on the
CPU without hf_tpu (rtol = atol = 1e-5: the ranks' gradients are averaged in a different order), compile nothing after
the first step, and each rank holds 1/N of the single chip's parameters, gradients and optimizer state (plus the
stated constant). Launches have a timeout and leave no process. The slow tier's tests share three launches (each rank
runs several jobs one after the other, see :data:`LAUNCHES`): starting a rank costs more CPU than these runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _timeouts import SAFETY_TIMEOUT_S

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from _fsdp_data import accelerate_loop, run_trainer
from _launch_util import launch, processes_mentioning
from _reference import without_hf_tpu
from train_helpers import VOCAB

pytestmark = [pytest.mark.distributed]
WORKER = "tests/training/_fsdp_worker.py"
STEPS = 3
# Per rank, beyond 1/N of the single chip's live bytes: the replicated rotary buffer, the batch, the loss and
# FSDP's padding of each shard to an equal size: 16 KiB for these models (each under 0.5 MB of training state).
CONSTANT = 16 * 1024


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    from hf_tpu.testing import tiny_model

    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            made[family] = tmp_path_factory.mktemp(f"fsdp-{family}") / family
            tiny_model(family, made[family], vocab_size=VOCAB, max_position_embeddings=64)
        return made[family]

    return make


def _launch(out: Path, ranks: int, jobs: list[tuple[Path, int, str]]) -> dict[tuple[str, str], list[dict]]:
    """One launch of ``ranks`` ranks running ``jobs`` (model folder, steps, mode) in order in each rank (see
    _fsdp_worker.py); the ranks' results of each job, by (mode, model folder name)."""
    out.mkdir(exist_ok=True)
    args = [str(a) for path, steps, mode in jobs for a in (path, steps, mode)]
    code, log, _ = launch(
        ["--simulate", f"--nproc_per_node={ranks}", WORKER, str(out), *args], timeout=SAFETY_TIMEOUT_S
    )
    assert code == 0, log[-6000:]
    assert not processes_mentioning(str(out)), "ranks left running after the launcher exited"
    found = {}
    for path, _, mode in jobs:
        results = [json.loads((out / f"{mode}-{path.name}" / f"rank{r}.json").read_text()) for r in range(ranks)]
        for r in results:
            assert "error" not in r, r["error"]
        found[mode, path.name] = results
    return found


# The slow tier's launches, each of several jobs run one after the other in each rank: a rank's start (torch,
# transformers, accelerate, hf_tpu) costs more CPU than these tiny models' few steps. name -> (ranks, jobs as (family,
# steps, mode), the launch that must run first). A job that checks that nothing compiles after its first step goes
# first in its launch (a process's earlier jobs could have seen a shape that is new to it); "resume" resumes the
# checkpoint of "four"'s "save". The tests that read a launch share an xdist group, so that one worker runs it once.
# The core tier's test (llama on 2 ranks) keeps a launch of its own.
LAUNCHES = {
    "four": (4, [("llama", STEPS, "trainer"), ("llama", 4, "save")], None),
    "two": (2, [("mixtral", STEPS, "trainer"), ("llama", STEPS, "accelerate"), ("llama", 1, "offload")], None),
    "two-after-four": (2, [("llama", STEPS, "bf16"), ("llama", 4, "resume")], "four"),
}
FOUR, TWO = pytest.mark.xdist_group("fsdp-four"), pytest.mark.xdist_group("fsdp-two")  # "two-after-four": FOUR


class _Launches:
    """``launched(name, mode, family)``: the ranks' results of that job of the launch ``name`` of :data:`LAUNCHES`,
    each launch run once, into one folder (``launched.out``), the first time a test asks for it."""

    def __init__(self, out: Path, family_dir) -> None:
        self.out, self._family_dir, self._done = out, family_dir, {}

    def __call__(self, name: str, mode: str, family: str = "llama") -> list[dict]:
        return self._run(name)[mode, family]

    def _run(self, name: str) -> dict:
        if name not in self._done:
            ranks, jobs, after = LAUNCHES[name]
            if after:
                self._run(after)
            jobs = [(self._family_dir(family), steps, mode) for family, steps, mode in jobs]
            self._done[name] = _launch(self.out, ranks, jobs)
        return self._done[name]


@pytest.fixture(scope="module")
def launched(family_dir, tmp_path_factory) -> _Launches:
    return _Launches(tmp_path_factory.mktemp("fsdp-launches"), family_dir)


@pytest.mark.parametrize(
    ("family", "ranks"),
    [("llama", 2), pytest.param("mixtral", 2, marks=TWO), pytest.param("llama", 4, marks=FOUR)],
)
def test_trainer_fsdp2_equals_one_process_on_the_whole_batch(family_dir, launched, tmp_path, family, ranks):
    from transformers import AutoModelForCausalLM

    path = family_dir(family)
    if (family, ranks) == ("llama", 2):  # the core tier's: a launch of its own
        results = _launch(tmp_path / "fsdp", ranks, [(path, STEPS, "trainer")])["trainer", family]
    else:
        results = launched("two" if ranks == 2 else "four", "trainer", family)

    with without_hf_tpu():  # one process, the whole batch, on the CPU, upstream code only
        _, cpu = run_trainer(AutoModelForCausalLM.from_pretrained(path), STEPS, 1, str(tmp_path / "cpu"), use_cpu=True)
    # one simulated chip, the whole batch, no FSDP: the memory a single chip needs
    _, one = run_trainer(AutoModelForCausalLM.from_pretrained(path).to("tpu"), STEPS, 1, str(tmp_path / "one"))

    assert len(cpu["losses"]) == STEPS
    for r in results:
        assert r["distributed_type"] == "DistributedType.FSDP"
        assert r["param_type"] == "DTensor" and r["device"] == "tpu:0"
        assert r["local_shape"][0] == -(-r["global_shape"][0] // ranks)  # dim 0 split over the ranks
        torch.testing.assert_close(r["losses"], cpu["losses"], rtol=1e-5, atol=1e-5)
        assert r["losses"] == results[0]["losses"]
        assert r["after_first"]["compiles"] == 0 and r["after_first"]["shape_signatures"] == 0, r["after_first"]
        # params + grads + optimizer state on this rank's chip: 1/N of one chip's, plus the constant
        assert r["memory"]["grads"] > 0 and r["memory"]["optimizer"] > 0
        assert r["memory"]["total"] <= one["memory"]["total"] / ranks + CONSTANT, (r["memory"], one["memory"])
        assert r["memory"]["live"] <= one["memory"]["live"] / ranks + CONSTANT, (r["memory"], one["memory"])
    torch.testing.assert_close(one["losses"], cpu["losses"], rtol=1e-5, atol=1e-5)


@FOUR
def test_sharded_checkpoint_of_4_ranks_resumes_on_2_and_exports_a_plain_model(family_dir, launched):
    """``state_dict_type="SHARDED_STATE_DICT"``: the Trainer's checkpoint is ``torch.distributed.checkpoint``, one file
    per rank (no rank writes the whole model); 2 ranks resume the 4 ranks' checkpoint of step 2 (DCP reshards it) and
    train steps 3 and 4 with the losses of the uninterrupted 4-rank run; ``accelerator.get_state_dict`` +
    ``save_pretrained`` export a model that ``from_pretrained`` loads equal to the trained weights."""
    from transformers import AutoModelForCausalLM

    path, steps = family_dir("llama"), 4
    saved = launched("four", "save")
    import torch.distributed.checkpoint as dcp

    checkpoint = launched.out / "save-llama" / "run" / "checkpoint-2" / "pytorch_model_fsdp_0"
    assert len(list(checkpoint.glob("*.distcp"))) == 4  # one file per rank
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    initial = dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())
    for name, weight in initial.items():  # each weight saved as 4 row blocks, each rank its own
        chunks = metadata.state_dict_metadata[f"model.{name}"].chunks
        assert [c.sizes[0] for c in chunks] == [weight.shape[0] // 4] * 4, (name, chunks)

    resumed = launched("two-after-four", "resume")
    assert len(saved[0]["losses"]) == steps and len(resumed[0]["losses"]) == steps - 2
    for r in resumed:
        torch.testing.assert_close(r["losses"], saved[0]["losses"][2:], rtol=1e-5, atol=1e-5)

    exported = AutoModelForCausalLM.from_pretrained(launched.out / "resume-llama" / "export")
    trained = torch.load(launched.out / "resume-llama" / "weights.pt")
    uninterrupted = torch.load(launched.out / "save-llama" / "weights.pt")
    loaded = dict(exported.named_parameters())
    assert set(loaded) == set(trained)
    for name, weight in trained.items():
        torch.testing.assert_close(loaded[name].detach(), weight, rtol=0, atol=0)
        torch.testing.assert_close(weight, uninterrupted[name], rtol=1e-5, atol=1e-5)
    # the weights moved in training: an export of the initial model would fail the comparison above
    assert any(not torch.allclose(initial[n].detach(), w, atol=1e-4) for n, w in trained.items())


@TWO
def test_accelerator_loop_with_the_fsdp2_plugin_equals_one_process(family_dir, launched):
    """``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy=
    "transformer_based_wrap"))`` in a plain loop on 2 ranks: the losses of one CPU process on the whole batches.
    The model comes from the host and is wrapped unit by unit: during ``prepare`` a chip holds at most its shards and
    one unit unsharded, never the whole model."""
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    path = family_dir("llama")
    results = launched("two", "accelerate")
    AcceleratorState._reset_state(True)
    try:
        with without_hf_tpu():
            cpu = accelerate_loop(AutoModelForCausalLM.from_pretrained(path), STEPS, fsdp=False, cpu=True)
    finally:
        AcceleratorState._reset_state(True)
    assert len(cpu) == STEPS
    model = AutoModelForCausalLM.from_pretrained(path)
    units = [*model.model.layers, model.model.embed_tokens, torch.nn.ModuleList([model.model.norm, model.lm_head])]
    largest_unit = max(sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in units)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    for r in results:
        assert r["memory"]["peak"] <= r["memory"]["live"] + largest_unit < whole, (r["memory"], largest_unit, whole)
        assert r["param_type"] == "DTensor" and r["device"] == "tpu:0" and r["local_shape"][0] * 2 == r["global_shape"][0]
        torch.testing.assert_close(r["losses"], cpu, rtol=1e-5, atol=1e-5)


@FOUR
def test_bf16_and_activation_checkpointing(family_dir, launched, tmp_path):
    """``bf16=True``: FSDP gathers bf16 weights for the forward and the optimizer updates fp32 shards; with
    ``fsdp_config={"activation_checkpointing": True}`` the layers are checkpointed. The logged loss is FSDP's bf16
    output (its spacing near 4.9 is 1/32, the mean of two ranks' half of it), so it matches the fp32 CPU run within
    0.05; nothing compiles after the first step."""
    from transformers import AutoModelForCausalLM

    path = family_dir("llama")
    results = launched("two-after-four", "bf16")
    with without_hf_tpu():
        _, cpu = run_trainer(AutoModelForCausalLM.from_pretrained(path), STEPS, 1, str(tmp_path / "cpu"), use_cpu=True)
    for r in results:
        assert r["gathered_dtypes"] == ["torch.bfloat16"] and r["sharded_dtype"] == "torch.float32"
        assert "CheckpointWrapper" in r["checkpointed"]
        assert r["after_first"]["compiles"] == 0 and r["after_first"]["shape_signatures"] == 0, r["after_first"]
        torch.testing.assert_close(r["losses"], cpu["losses"], rtol=0, atol=0.05)


@TWO
def test_cpu_offload_is_refused_with_the_fix(launched):
    results = launched("two", "offload")
    for r in results:
        assert r.get("refused", "").startswith("TPUTrainingError: FSDP CPU offload"), r
        assert "--nproc_per_node" in r["refused"]


def test_fsdp_plugin_checks():
    from accelerate.utils import FullyShardedDataParallelPlugin

    from hf_tpu.training import TPUTrainingError
    from hf_tpu.training.fsdp import check_fsdp_plugin

    check_fsdp_plugin(FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap"))
    with pytest.raises(TPUTrainingError, match=r"fsdp_config=\{'fsdp_version': 2\}"):
        check_fsdp_plugin(FullyShardedDataParallelPlugin(fsdp_version=1))
    with pytest.raises(TPUTrainingError, match="CPU offload"):
        check_fsdp_plugin(FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=True))
    offloaded = FullyShardedDataParallelPlugin(
        fsdp_version=2, activation_checkpointing=True, activation_checkpointing_offload=True
    )
    with pytest.raises(TPUTrainingError, match="without the offload"):
        check_fsdp_plugin(offloaded)


def test_move_to_tpu_keeps_identity_where_torch_refuses_set_data():
    """torch refuses ``cpu_param.data = tpu_tensor`` (PrivateUse1 is not among the dense backends of
    ``has_compatible_shallow_copy_type``); ``move_to_tpu`` moves in place and tied weights stay one object."""
    from hf_tpu.testing import tiny_model
    from hf_tpu.training.fsdp import move_to_tpu

    model = tiny_model("llama", vocab_size=VOCAB, tie_word_embeddings=True)
    param = model.model.embed_tokens.weight
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        param.data = param.to("tpu")
    expected = param.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters())
    move_to_tpu(list(model.parameters()) + list(model.buffers()), torch.device("tpu", 0))
    assert model.model.embed_tokens.weight is param and model.lm_head.weight is param
    assert param.device.type == "tpu" and isinstance(param, torch.nn.Parameter) and param.requires_grad
    assert optimizer.param_groups[0]["params"][0] is param
    assert all(b.device.type == "tpu" for b in model.buffers())
    torch.testing.assert_close(param.detach().cpu(), expected, rtol=0, atol=0)
