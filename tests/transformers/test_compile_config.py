"""``generate(compile_config=CompileConfig())`` on a tpu model fails early, naming the fix.

(``_check_compile_config`` in hf_tpu/transformers/generation.py)
"""

import pytest
import torch
from transformers import CompileConfig, GenerationConfig

import hf_tpu.sim

PROMPT = [[5, 9, 11, 17]]
CASES = {
    "kwarg": lambda m, ids: m.generate(ids, max_new_tokens=2, do_sample=False, compile_config=CompileConfig()),
    "generation_config": lambda m, ids: m.generate(
        ids, max_new_tokens=2, generation_config=GenerationConfig(do_sample=False, compile_config=CompileConfig())
    ),
    "static_cache": lambda m, ids: m.generate(
        ids, max_new_tokens=2, do_sample=False, cache_implementation="static", compile_config=CompileConfig()
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_inductor_compile_config_on_a_tpu_model_is_refused_before_any_work(pair, case):
    cpu, tpu = pair("llama")
    ids = torch.tensor(PROMPT, device="tpu")
    with hf_tpu.sim.stats() as s, pytest.raises(ValueError, match=r"CompileConfig\(backend='tpu'") as info:
        CASES[case](tpu, ids)
    assert "backend='inductor'" in str(info.value)
    assert s.ops == 0 and s.compiles == 0


def test_other_compile_configs_and_other_devices_are_untouched(pair):
    cpu, tpu = pair("llama")
    ids = torch.tensor(PROMPT)
    ref = cpu.generate(ids, max_new_tokens=3, do_sample=False, compile_config=CompileConfig())
    tpu_config = CompileConfig(backend="tpu", mode="default")
    out = tpu.generate(ids.to("tpu"), max_new_tokens=3, do_sample=False, compile_config=tpu_config)
    assert torch.equal(out.cpu(), ref)
    out = tpu.generate(
        ids.to("tpu"), max_new_tokens=3, do_sample=False, compile_config=CompileConfig(), disable_compile=True
    )
    assert torch.equal(out.cpu(), ref)
