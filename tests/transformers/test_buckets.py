import pytest

from hf_tpu.transformers.buckets import BucketLadder, BucketOverflowError, default_ladder


def test_powers_of_two_and_rounding():
    ladder = BucketLadder.powers_of_two(16, 512)
    assert ladder.rungs == (16, 32, 64, 128, 256, 512)
    assert [ladder.bucket(n) for n in (1, 16, 17, 100, 512)] == [16, 16, 32, 128, 512]
    assert ladder.up_to(33) == (16, 32, 64)
    assert ladder.at_least(100) == (128, 256, 512)
    assert BucketLadder.powers_of_two(16, 100).rungs == (16, 32, 64, 100)


def test_coerce_sorts_and_dedups():
    assert BucketLadder.coerce([64, 16, 16, 32]).rungs == (16, 32, 64)
    with pytest.raises(ValueError, match="at least one positive"):
        BucketLadder(())


def test_overflow_names_the_length_and_the_fix():
    ladder = BucketLadder((16, 32))
    with pytest.raises(BucketOverflowError, match=r"the prompt is 40 tokens, past the largest bucket \(32"):
        ladder.bucket(40, "the prompt")


def test_default_ladder_follows_the_model_limit():
    from transformers import GPT2Config, T5Config

    assert default_ladder(GPT2Config(n_positions=200)).rungs == (16, 32, 64, 128, 200)
    assert default_ladder(T5Config()).max == 4096  # relative positions: no limit in the config


def test_tiered_doubles_then_steps_then_eight_per_octave():
    from hf_tpu.transformers.buckets import BucketLadder

    rungs = BucketLadder.tiered(16, 256, 8192).rungs
    assert rungs[:6] == (16, 32, 64, 128, 256, 512)
    assert all(b - a == 256 for a, b in zip(rungs[4:], rungs[5:]) if b <= 4096)
    assert all(b - a == 512 for a, b in zip(rungs, rungs[1:]) if a >= 4096)
    assert len(BucketLadder.tiered(16, 256, 2048).rungs) == 12
    with pytest.raises(ValueError, match="tiered needs"):
        BucketLadder.tiered(0, 256, 1024)


def test_cache_length_is_a_power_of_two_then_a_multiple():
    from hf_tpu.transformers.buckets import cache_length

    assert [cache_length(n) for n in (1, 16, 17, 100, 128, 129, 519, 640)] == [16, 16, 32, 128, 128, 256, 640, 640]
    assert cache_length(130, multiple=64) == 192
