"""The default ladder's figures, computed through ``plan_shapes`` for prompts uniform in [1, 2048].

Targets (issue #15): at most 12% of prefill tokens are padding, at most 25% of static-cache slots unused, at most 32
graphs for one batch size; the earlier ladder (powers of two for prompts and caches) is measured the same way and
misses them, so the figures are the ladder's, not the test's.
"""

from __future__ import annotations

import pytest

from hf_tpu.transformers import configure
from hf_tpu.transformers.buckets import BucketLadder
from hf_tpu.transformers.generation import ladder_figures, plan_shapes

PROMPTS = range(1, 2049)


class _Config:
    """Just what plan_shapes reads from a model config."""

    max_position_embeddings = 4096

    def get_text_config(self, decoder=True):
        return self


class _Model:
    def __init__(self):
        self.config = _Config()


@pytest.mark.parametrize("new_tokens", [16, 128, 512])
def test_default_ladder_meets_the_targets(new_tokens):
    figures = ladder_figures(_Model(), PROMPTS, new_tokens)
    assert figures["padding"] <= 0.12, figures
    assert figures["unused_cache"] <= 0.25, figures
    assert figures["graphs"] <= 32, figures


@pytest.mark.parametrize("new_tokens", [16, 128, 512])
def test_power_of_two_ladder_misses_them(new_tokens):
    model = _Model()
    configure(model, buckets=BucketLadder.powers_of_two(16, 4096), cache_multiple=None)
    figures = ladder_figures(model, PROMPTS, new_tokens)
    assert figures["padding"] > 0.2 and figures["unused_cache"] > 0.4, figures


def test_the_cache_follows_prompt_plus_new_tokens():
    model = _Model()
    plan = plan_shapes(model, 1, 500, 8)
    assert (plan.prompt_bucket, plan.cache_bucket) == (512, 640)  # not 1024, the power of two above 512 + 8
    assert plan.cache_bucket >= plan.prompt_bucket + 8 - 1
    configure(model, cache_multiple=None)
    assert plan_shapes(model, 1, 500, 8).cache_bucket == 768  # on the ladder's rungs: 512, 768, ...
    with pytest.raises(ValueError, match="cache_multiple must be a positive integer or None"):
        configure(model, cache_multiple=0)
