"""``scripts/run_transformers_tests.py --hf-tpu`` on a stand-in for transformers' test tree (its model tests are not in
the wheel): the third run enables hf_tpu's generation, and the summary counts, per model family, the tests that ran
hf_tpu's loop (greedy search does, beam search runs upstream's) and those that pass with hf_tpu off and on."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "run_transformers_tests.py"

TESTS = '''
import torch
import transformers
from transformers.testing_utils import torch_device


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval().to(torch_device)


class TestLlamaStandIn:
    def test_greedy(self):
        ids = torch.tensor([[5, 6, 7]], device=torch_device)
        assert _model().generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 6)

    def test_beam_search(self):
        ids = torch.tensor([[5, 6, 7]], device=torch_device)
        assert _model().generate(ids, max_new_tokens=3, num_beams=2, do_sample=False).shape == (1, 6)

    def test_runs_on_the_tpu_when_asked(self):
        assert torch_device in ("cpu", "tpu")
'''


def test_the_hf_tpu_run_counts_the_tests_its_loop_served(tmp_path, capsys):
    folder = tmp_path / "tests" / "models" / "llama"
    folder.mkdir(parents=True)
    (folder / "test_modeling_llama.py").write_text(textwrap.dedent(TESTS))
    spec = importlib.util.spec_from_file_location("run_transformers_tests", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    status = script.main(["--hf-tpu", "--pytest-args=-p no:warnings", str(tmp_path), "tests/models/llama"])
    out = capsys.readouterr().out
    assert status == 0, out
    summary = "tests.models.llama: 3 tests, 1 ran hf_tpu's loop (1 passed); passed: 3 with hf_tpu off, 3 with it on"
    assert summary in out
    assert "pass with hf_tpu off, not with it on: 0" in out
