"""``scripts/run_transformers_tests.py --hf-tpu`` on a stand-in for transformers' test tree (its model tests are not in
the wheel): the third run enables hf_tpu's generation, and the summary counts, per model family, the tests that ran
hf_tpu's loop (greedy and beam search do; beam search with a stopping criterion of its own runs upstream's) and those
that pass with hf_tpu off and on."""

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

    def test_beam_search_with_a_stopping_criterion(self):
        class Never(transformers.StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        ids = torch.tensor([[5, 6, 7]], device=torch_device)
        stop = transformers.StoppingCriteriaList([Never()])
        out = _model().generate(ids, max_new_tokens=3, num_beams=2, do_sample=False, stopping_criteria=stop)
        assert out.shape == (1, 6)

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
    summary = "tests.models.llama: 4 tests, 2 ran hf_tpu's loop (2 passed); passed: 4 with hf_tpu off, 4 with it on"
    assert summary in out
    missed = (  # (the stopping criterion's beam call runs upstream's loop; the last test calls no generate)
        "  not on hf_tpu's loop: test_beam_search_with_a_stopping_criterion (passed), "
        "test_runs_on_the_tpu_when_asked (passed)"
    )
    assert missed in out, out
    assert "pass with hf_tpu off, not with it on: 0" in out


TREE_SCRIPT = SCRIPT.parent / "transformers_test_tree.py"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_transformers_repo(root: Path) -> Path:
    """A git repository laid out like transformers' (an older one: its tests import a setting the installed
    transformers.testing_utils no longer has, and the mixins a helper module it lacks)."""
    import subprocess

    files = {
        "conftest.py": "",
        "pyproject.toml": "[tool.pytest.ini_options]\nmarkers = ['generate: old']\n",
        "src/transformers/__init__.py": '__version__ = "5.16.0.dev0"\n',
        "src/transformers/testing_utils.py": "_GONE_DEFAULTS = {'batch_size': 13}\nNOT_A_LITERAL = object()\n",
        "tests/__init__.py": "",
        "tests/causal_lm_tester.py": (
            "from transformers.testing_utils import (\n    _GONE_DEFAULTS,\n    torch_device,\n)\n\n"
            "BATCH = _GONE_DEFAULTS['batch_size']\n"
        ),
        "tests/test_fsdp_mixin.py": "from .distributed_testing_utils import run_distributed\n",
        "tests/generation/__init__.py": "",
        "tests/generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
        "tests/models/__init__.py": "",
        "tests/models/llama/__init__.py": "",
        "tests/models/llama/test_modeling_llama.py": "from ...causal_lm_tester import BATCH\n",
        "tests/models/bert/test_modeling_bert.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(root)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "tree"], check=True)
    return root / ".git"


def test_the_tree_script_assembles_an_importable_tree_from_an_older_source(tmp_path, capsys):
    import subprocess
    import sys
    import tarfile

    import transformers

    git_dir = _fake_transformers_repo(tmp_path / "repo")
    sdist_root = tmp_path / "sdist" / f"transformers-{transformers.__version__}"
    (sdist_root / "tests").mkdir(parents=True)
    (sdist_root / "tests" / "test_modeling_common.py").write_text("FROM_SDIST = True\n")
    (sdist_root / "pyproject.toml").write_text("[tool.pytest.ini_options]\nmarkers = ['generate: new']\n")
    sdist = tmp_path / "transformers.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(sdist_root, arcname=sdist_root.name)
    dest = tmp_path / "tree"
    argv = [str(dest), "--git-dir", str(git_dir), "--sdist", str(sdist), "--models", "llama"]
    status = _load(TREE_SCRIPT).main(argv)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "transformers 5.16.0.dev0" in out and f"installed: transformers {transformers.__version__}" in out
    assert (dest / "tests/models/llama/test_modeling_llama.py").exists() and not (dest / "tests/models/bert").exists()
    assert (dest / "tests/test_modeling_common.py").read_text() == "FROM_SDIST = True\n"
    assert "generate: new" in (dest / "pyproject.toml").read_text()
    tester = (dest / "tests/causal_lm_tester.py").read_text()
    assert "from transformers.testing_utils import torch_device\n" in tester and "_GONE_DEFAULTS = {" in tester
    assert "defined _GONE_DEFAULTS" in out and "tests/distributed_testing_utils.py: stand-in" in out
    assert (dest / "src/transformers").resolve() == Path(transformers.__file__).parent.resolve()
    check = (
        "import unittest, tests.models.llama.test_modeling_llama as m, tests.distributed_testing_utils as d\n"
        "assert m.BATCH == 13\n"
        "try:\n    d.run_distributed()\nexcept unittest.SkipTest:\n    print('skipped')\n"
    )
    done = subprocess.run([sys.executable, "-c", check], cwd=dest, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "skipped", done.stderr
