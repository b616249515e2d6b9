"""``hf-tpu generate`` on the simulated device, against upstream ``generate`` on CPU with the same files."""

from __future__ import annotations

import argparse
import re

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


def test_a_sampled_run_finds_its_graphs_warm_and_repeats_with_its_seed(tmp_path, capsys):
    """--do-sample: warm-up compiles the sampling graphs (before, it warmed the greedy ones and the run compiled its
    own mid-generation, as a v5e showed); the same seed gives the same text."""
    _tiny_model_dir(tmp_path)
    texts = []
    for _ in range(2):
        args = _args(argv=[str(tmp_path), "--prompt", "the king said", "--max-new-tokens", "6", "--do-sample",
                           "--temperature", "1.5", "--top-k", "8", "--seed", "3", "--stats"])  # fmt: skip
        with hf_tpu.enabled("generation"):
            assert command.run(args) == 0
        out, err = capsys.readouterr()
        compiles = re.search(r"compiles \(torch\.compile[^)]*\):\s*(\d+)", err)
        assert compiles and compiles.group(1) == "0", err  # --stats: nothing compiled after warm-up
        texts.append(out.strip())
    assert texts[0] == texts[1]


def _cpu_text(path, tok, ids, new_tokens: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    cpu = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([ids])
    expected = cpu.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens)
    return tok.decode(expected[0], skip_special_tokens=True).strip()


def test_rejects_a_prompt_past_the_largest_bucket_naming_the_flags(tmp_path, capsys):
    _tiny_model_dir(tmp_path)
    args = _args(argv=[str(tmp_path), "--prompt", " ".join(["king"] * 130), "--max-new-tokens", "2"])
    assert command.run(args) == 2
    err = capsys.readouterr().err
    # past the model's 128 positions no ladder helps (one reaching 256 gave degenerate text): keep the last 127 tokens
    assert "needs 131 positions, past the model's max_position_embeddings (128)" in err
    assert "--max-prompt-len 127" in err and "--buckets 16" not in err
    assert "configure(" not in err  # no Python API advice to a command-line user


def test_rejects_a_cache_past_the_models_context_naming_the_flags(tmp_path, capsys):
    _tiny_model_dir(tmp_path)
    args = _args(argv=[str(tmp_path), "--prompt", " ".join(["king"] * 100), "--max-new-tokens", "40"])
    assert command.run(args) == 2
    err = capsys.readouterr().err
    # 139 positions pass the model's 128: no ladder is suggested, the flags that fit are
    assert "needs 139 positions, past the model's max_position_embeddings (128)" in err
    assert "lower --max-new-tokens" in err and "--max-prompt-len 89" in err and "--buckets 16" not in err


def test_buckets_flag_lets_a_long_prompt_through_with_the_cpu_text(tmp_path, capsys):
    """The flag the error recommends works: the ladder is the one given, and the text equals CPU generate."""
    tok = _tiny_model_dir(tmp_path)
    prompt = " ".join(["king"] * 130)
    args = _args(argv=[str(tmp_path), "--prompt", prompt, "--max-new-tokens", "3", "--buckets", "64,256"])
    assert args.buckets == (64, 256)
    assert command.run(args) == 0
    out = capsys.readouterr().out
    assert out.strip() == _cpu_text(tmp_path, tok, tok(prompt)["input_ids"], 3)


def test_max_prompt_len_keeps_the_end_of_the_prompt(tmp_path, capsys):
    tok = _tiny_model_dir(tmp_path)
    prompt = " ".join(TEXT.split() * 8)  # 152 tokens, past the largest bucket
    args = _args(
        argv=["--model", str(tmp_path), "--prompt", prompt, "--max-new-tokens", "4", "--max-prompt-len", "20"]
    )
    assert command.run(args) == 0
    out = capsys.readouterr().out
    assert out.strip() == _cpu_text(tmp_path, tok, tok(prompt)["input_ids"][-20:], 4)


@pytest.mark.parametrize("bad", ["0,16", "a,b", ""])
def test_buckets_flag_refuses_what_is_not_a_ladder(bad):
    with pytest.raises(SystemExit):
        _args(argv=["--buckets", bad])


def test_register_defines_the_documented_flags():
    args = _args(argv=["--prompt", "hi", "--max-new-tokens", "3", "--do-sample", "--seed", "1"])
    assert (args.model_dir, args.prompt, args.max_new_tokens, args.do_sample, args.seed) == (None, "hi", 3, True, 1)
    assert (args.model_opt, args.buckets, args.max_prompt_len) == (None, None, None)
    assert _args(argv=["--model", "some/dir"]).model_opt == "some/dir"  # the spelling examples/tp_generate.py uses
    with pytest.raises(SystemExit):
        _args(argv=["--max-new-tokens", "many"])


def test_main_dispatches_to_the_generate_command():
    from hf_tpu.cli.main import build_parser

    argv = ["generate", "some/dir", "--prompt", "hi", "--simulate"]
    args = build_parser(argv).parse_args(argv)
    assert args._module is command and args.model_dir == "some/dir" and args.simulate


def test_the_max_prompt_len_advised_for_a_long_prompt_warms_up_and_equals_cpu(tmp_path, capsys):
    """issue 36: the advice "--max-prompt-len 249" for a 1402-token prompt, followed, warned that there was no
    warm-up (the warm-up compiles the prompt's bucket, 256, plus the new tokens). The first value advised now warms
    up; the longer one, said with its cost, still runs."""
    import re

    tok = _tiny_model_dir(tmp_path)
    prompt = " ".join(["king", "queen", "prince"] * 50)  # 150 tokens, past the largest bucket (128)
    argv = [str(tmp_path), "--prompt", prompt, "--max-new-tokens", "8"]
    assert command.run(_args(argv=argv)) == 2
    err = capsys.readouterr().err
    advised = [int(n) for n in re.findall(r"--max-prompt-len (\d+)", err)]
    assert advised == [64, 121], err  # a rung whose bucket + 8 new tokens fits 128; 121 fits without a warm-up
    assert "without a warm-up" in err
    ids = tok(prompt)["input_ids"]
    for keep, warmed in zip(advised, (True, False)):
        assert command.run(_args(argv=[*argv, "--max-prompt-len", str(keep)])) == 0
        out, err = capsys.readouterr()
        assert ("no warm-up" not in err) is warmed, err
        assert out.strip() == _cpu_text(tmp_path, tok, ids[-keep:], 8)


def test_a_suggested_ladder_stays_within_the_models_context():
    from hf_tpu.cli.generate import _overflow

    # a cache of 139 positions fits a 512-position model: the ladder offered reaches 256, not past 512
    assert "--buckets 16,32,64,128,256." in _overflow(100, 40, (16, 32, 64, 128), 512)
    # a model of 200 positions: the ladder's last rung is its context, never the next power of two
    assert "--buckets 16,32,64,128,200." in _overflow(150, 10, (16, 32, 64, 128), 200)
    assert _overflow(100, 29, (16, 32, 64, 128), 128) is None
