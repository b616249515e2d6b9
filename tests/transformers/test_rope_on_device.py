"""PhiMoE's rotary frequencies come from the device: one small copy each way per decode step, tokens as on CPU
(hf_tpu/transformers/_rope_on_device.py; its rotary embedding rebuilt them on the host at every forward)."""

from __future__ import annotations

import torch

import hf_tpu.sim
from hf_tpu.transformers import generation

KW = {"do_sample": False, "eos_token_id": None}


def test_phimoe_decode_step_copies_one_small_tensor_each_way(pair):
    cpu, tpu = pair("phimoe")
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    tpu.generate(ids, max_new_tokens=2, **KW)  # compiles the prefill and decode graphs
    with hf_tpu.sim.stats() as long:
        got = tpu.generate(ids, max_new_tokens=6, **KW)
    with hf_tpu.sim.stats() as short:
        tpu.generate(ids, max_new_tokens=2, **KW)
    assert torch.equal(got, cpu.generate(ids, max_new_tokens=6, **KW))
    assert {k[0] for k in generation.compiled_graphs(tpu)} == {"prefill", "decode"}  # hf_tpu's loop ran
    assert long.compiles == short.compiles == 0
    steps = 4  # the decode steps the longer call ran beyond the shorter one
    assert long.h2d_copies - short.h2d_copies <= steps, (long, short)
    assert long.d2h_copies - short.d2h_copies <= steps, (long, short)
