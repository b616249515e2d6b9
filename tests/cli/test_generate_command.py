"""``hf-tpu generate`` on the simulated device, against upstream ``generate`` on CPU with the same files."""

from __future__ import annotations

import argparse

import pytest

import hf_tpu
from hf_tpu.cli import generate as command

TEXT = "the king said that the queen and the prince would ride to the castle at dawn with the guard"


def _tiny_model_dir(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hf_tpu.testing import tiny_model

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(path)
    tiny_model("llama", path, vocab_size=fast.vocab_size, max_position_embeddings=128, eos_token_id=None)
    return fast


def _args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["generate", *overrides.pop("argv", [])])
    args.simulate = True
    return args


def test_streams_the_same_text_as_cpu_generate(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    tok = _tiny_model_dir(tmp_path)
    args = _args(argv=[str(tmp_path), "--prompt", "the king said", "--max-new-tokens", "6", "--stats"])
    with hf_tpu.enabled("generation"):
        assert command.run(args) == 0
    out, err = capsys.readouterr()
    cpu = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    inputs = tok("the king said", return_tensors="pt")
    expected = cpu.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert out.strip() == tok.decode(expected[0], skip_special_tokens=True).strip()
    assert "6 tokens in" in err and "loading" in err and "warm-up" in err
    assert "compiles" in err  # --stats printed the counters


def test_rejects_a_prompt_past_the_largest_bucket(tmp_path, capsys):
    _tiny_model_dir(tmp_path)
    args = _args(argv=[str(tmp_path), "--prompt", " ".join(["king"] * 130), "--max-new-tokens", "2"])
    assert command.run(args) == 2
    assert "past the largest bucket (128" in capsys.readouterr().err


def test_register_defines_the_documented_flags():
    args = _args(argv=["--prompt", "hi", "--max-new-tokens", "3", "--do-sample", "--seed", "1"])
    assert (args.model_dir, args.prompt, args.max_new_tokens, args.do_sample, args.seed) == (None, "hi", 3, True, 1)
    with pytest.raises(SystemExit):
        _args(argv=["--max-new-tokens", "many"])


def test_main_dispatches_to_the_generate_command():
    from hf_tpu.cli.main import build_parser

    argv = ["generate", "some/dir", "--prompt", "hi", "--simulate"]
    args = build_parser(argv).parse_args(argv)
    assert args._module is command and args.model_dir == "some/dir" and args.simulate
