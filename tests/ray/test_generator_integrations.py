"""HfTpuGenerate and hf_tpu's integrations: a generator holds them while it lives and leaves the caller's process as
it found it (a module of its own: no other generator may be alive while it runs, as tests/ray/test_generate_batch.py's
module fixture is)."""

from __future__ import annotations

import hf_tpu
from hf_tpu._patch import INTEGRATIONS
from hf_tpu.assets import default_model_path
from hf_tpu.ray import HfTpuGenerate

MODEL = str(default_model_path())


def enabled_integrations() -> set[str]:
    return {name for name in INTEGRATIONS if hf_tpu.is_enabled(name)}


def test_a_generator_holds_the_integrations_while_it_lives_and_leaves_the_callers_as_they_were():
    """Out of Ray (here, a notebook) the integrations are in force while a generator lives, between its calls too
    (an actor's batches pay nothing to turn them on); once the last one is collected or closed, those it enabled are
    disabled and the caller's own stay enabled."""
    import gc

    gc.collect()  # (a generator of an earlier test, waiting for the collector, would still hold them)
    with hf_tpu.enabled("kernels"):  # the caller's own
        before = enabled_integrations()
        assert before != set(INTEGRATIONS), "another test left every integration enabled"
        gen = HfTpuGenerate(MODEL, batch_size=1, max_new_tokens=2, max_prompt_len=8, simulate=True)
        other = HfTpuGenerate(MODEL, batch_size=1, max_new_tokens=2, max_prompt_len=8, simulate=True)
        assert enabled_integrations() == set(INTEGRATIONS)
        out = gen({"prompt": ["The king said"]})
        assert out["error"][0] is None and out["generated_token_ids"][0].size > 0
        assert enabled_integrations() == set(INTEGRATIONS)
        del gen
        gc.collect()
        assert enabled_integrations() == set(INTEGRATIONS)  # the other generator still lives
        other.close()
        assert enabled_integrations() == before
        other.close()  # a second close does nothing
        assert enabled_integrations() == before
