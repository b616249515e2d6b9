"""HfTpuGenerate in one process, without Ray: a batch in, rows out equal to the CPU's greedy generate, every row
accounted for (a too-long prompt, a failing batch) and bad arguments refused with the fix."""

from __future__ import annotations

import numpy as np
import pytest

from hf_tpu.assets import default_model_path
from hf_tpu.errors import UserError
from hf_tpu.ray import HfTpuGenerate
from hf_tpu.ray.local import cpu_greedy_rows, heldout_prompts

MODEL = str(default_model_path())  # the model that ships with hf_tpu, with its tokenizer

NEW_TOKENS = 4


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    reports = tmp_path_factory.mktemp("reports")
    gen = HfTpuGenerate(MODEL, batch_size=2, max_new_tokens=NEW_TOKENS, max_prompt_len=16, simulate=True,
                        start_reports=reports)  # fmt: skip
    yield gen, reports
    gen.close()  # the integrations it enabled go now, not whenever the collector finds it


def test_rows_equal_cpu_greedy_and_a_short_batch_is_padded_not_recompiled(generator):
    from hf_tpu import sim

    gen, reports = generator
    prompts = heldout_prompts(5)  # 5 rows, batch size 2: two full generate calls and one padded
    with sim.stats() as s:
        out = gen({"prompt": np.array(prompts), "id": np.arange(5)})
    assert s.compiles == 0  # warm-up covered every call, the short one too
    assert list(out["id"]) == list(range(5)) and list(out["prompt"]) == prompts  # input columns kept, in order
    assert list(out["error"]) == [None] * 5
    expected = cpu_greedy_rows(MODEL, prompts, NEW_TOKENS)
    assert [ids.tolist() for ids in out["generated_token_ids"]] == expected
    assert list(out["generated_text"]) == [gen.tokenizer.decode(t, skip_special_tokens=True) for t in expected]
    (report,) = [p.read_text() for p in reports.iterdir()]
    assert gen.start_report.graphs > 0 and f'"graphs": {gen.start_report.graphs}' in report


def test_a_too_long_prompt_gets_an_error_row_and_the_others_their_output(generator):
    gen, _ = generator
    prompts = ["The king said", "word " * 40]
    out = gen({"prompt": prompts})
    assert out["error"][0] is None and out["generated_token_ids"][0].size > 0
    assert "longer than max_prompt_len=16" in out["error"][1] and out["generated_text"][1] == ""


def test_a_failing_batch_is_retried_row_by_row_and_only_the_bad_row_fails(generator, monkeypatch):
    gen, _ = generator
    prompts = heldout_prompts(2)
    upstream = gen._generate

    def flaky(rows):
        if any(len(r) == len(gen.tokenizer(prompts[1])["input_ids"]) for r in rows):
            raise RuntimeError("device lost")
        return upstream(rows)

    monkeypatch.setattr(gen, "_generate", flaky)
    out = gen({"prompt": prompts})
    assert out["error"][0] is None
    assert out["generated_token_ids"][0].tolist() == cpu_greedy_rows(MODEL, prompts[:1], NEW_TOKENS)[0]
    assert out["error"][1] == "RuntimeError: device lost"


def test_bad_arguments_name_the_fix(generator):
    gen, _ = generator
    with pytest.raises(UserError, match="no column 'prompt'.*prompt_column"):
        gen({"text": ["hello"]})
    with pytest.raises(UserError, match="resources=\\{'TPU': 1\\}.*hf_tpu.ray.serve with tp=4"):
        HfTpuGenerate(MODEL, tp_size=4)
    with pytest.raises(UserError, match="batch_size=0"):
        HfTpuGenerate(MODEL, batch_size=0)
