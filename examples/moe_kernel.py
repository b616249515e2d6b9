"""The seed's MoE flow on the simulated tpu device: a Hub kernel registered as transformers' experts implementation.

    kernel = get_kernel("…/ragged-dot-tpu", version=1, trust_remote_code=[…])
    ALL_EXPERTS_FUNCTIONS.register("ragged_dot_tpu", kernel.experts_forward)
    model = AutoModelForCausalLM.from_pretrained(…, experts_implementation="ragged_dot_tpu")

Here the kernel comes from the copy that ships inside hf_tpu (no Hub access needed), the model is a tiny random
Qwen3-MoE saved to a temporary folder, and the simulator's counters show what the kernel saves over the default
expert loop: with the loop every new routing brings new shapes (on a TPU, new compiles) and host syncs.

Run (needs jax: ``pip install 'hf-tpu[kernels]'``):

    HF_TPU_SIMULATE=1 python examples/moe_kernel.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

if importlib.util.find_spec("jax") is None:  # the kernel's XLA path is written in jax; the demo install has none
    sys.exit("examples/moe_kernel.py needs jax, which is not installed: pip install 'hf-tpu[kernels]'")

import torch
from kernels import get_local_kernel
from transformers import AutoModelForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import hf_tpu.sim
from hf_tpu.kernels import RAGGED_DOT_REPO
from hf_tpu.testing import tiny_model


def main() -> None:
    hf_tpu.sim.enable()  # a `tpu` device over CPU memory; on a TPU VM leave this out
    # greedy tokens are compared with the CPU's below: float32 products ('medium', a TPU's default and the
    # simulator's, is one bfloat16 pass, which can flip a near-tie)
    torch.set_float32_matmul_precision("highest")

    # 1. The kernel, from its Hub-layout folder. From the Hub it would be
    #    get_kernel("<org>/ragged-dot-tpu", version=1, trust_remote_code=["<org>/ragged-dot-tpu"]).
    kernel = get_local_kernel(RAGGED_DOT_REPO)
    # 2. Register it in transformers' experts interface (hf_tpu.kernels.use_ragged_dot_experts() does 1 + 2,
    #    reversibly).
    ALL_EXPERTS_FUNCTIONS.register("ragged_dot_tpu", kernel.experts_forward)

    sizes = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32}
    with tempfile.TemporaryDirectory() as path:
        config = tiny_model("qwen3_moe", path, head_dim=16, num_experts=16, num_experts_per_tok=4, **sizes).config
        models = {
            impl: AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl).eval().to("tpu")
            for impl in ("ragged_dot_tpu", "eager")
        }

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (4, 12), generator=g).to("tpu") for _ in range(6)]
    with torch.no_grad():
        for impl, model in models.items():
            model(batches[0])  # warm-up: every shape the model needs for this batch size and length
            with hf_tpu.sim.stats() as s:
                for batch in batches[1:]:  # same shapes, new tokens: new routings
                    model(batch)
            print(
                f"{impl:>15}: 5 forwards of new tokens after a warm-up: new eager shape signatures "
                f"{s.shape_signatures:4d}, host syncs {s.host_syncs:4d}, device ops {s.ops}"
            )
    outputs = {
        impl: model.generate(batches[0], max_new_tokens=8, do_sample=False).cpu() for impl, model in models.items()
    }
    print("greedy tokens identical:", torch.equal(outputs["ragged_dot_tpu"], outputs["eager"]))
    print("generated:", outputs["ragged_dot_tpu"][0, 12:].tolist())


if __name__ == "__main__":
    main()
