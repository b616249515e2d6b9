"""Run a tiny Llama on the simulated TPU and read the counters that predict its cost on a real one.

    HF_TPU_SIMULATE=1 python examples/simulator_counters.py

No TPU and no download needed: the model is built from a config with random weights.
"""

import torch

import hf_tpu.sim
from hf_tpu.testing import tiny_model

hf_tpu.sim.enable(generation="v6e")  # also: HF_TPU_SIMULATE=1, or `import hf_tpu.sim`

model = tiny_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128).to("tpu")
print("device:", next(model.parameters()).device, "-", torch.tpu.get_device_name())

ids = torch.randint(0, 256, (2, 12))
mask = torch.ones_like(ids)
with hf_tpu.sim.stats() as first:
    out = model.generate(ids.to("tpu"), attention_mask=mask.to("tpu"), max_new_tokens=8, do_sample=False)
print("\nfirst generate (every op shape is new: on a TPU each one compiles):")
print(first.report())

with hf_tpu.sim.stats() as second:
    model.generate(ids.to("tpu"), attention_mask=mask.to("tpu"), max_new_tokens=8, do_sample=False)
print("\nsame call again (nothing new to compile):")
print(second.report())
assert second.shape_signatures == 0

# A compiled forward: one compile per new input shape.
forward = torch.compile(model.forward, backend="tpu", dynamic=False)
with torch.no_grad(), hf_tpu.sim.stats() as s:
    forward(input_ids=ids.to("tpu"))
    forward(input_ids=ids.to("tpu"))
print(f"\ntorch.compile(backend='tpu'): {s.compiles} compile(s) for two calls with the same shape")

# strict(): prove a step neither syncs with the host nor compiles.
x = torch.randn(4, 64, device="tpu")
with hf_tpu.sim.strict():
    y = model.model.layers[0].mlp(x)  # fine: stays on the device
try:
    with hf_tpu.sim.strict():
        y.sum().item()
except hf_tpu.sim.SimStrictError as e:
    print("\nstrict mode caught:", str(e)[:90], "...")
print("\ntokens:", out[0].tolist())
