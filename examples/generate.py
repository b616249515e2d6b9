"""Text generation on a TPU with hf_tpu: static cache, shape buckets, warm-up, host-side bookkeeping.

Runs on a TPU VM, or anywhere on the simulated ``tpu`` device (also used automatically when there is no TPU):

    HF_TPU_SIMULATE=1 python examples/generate.py                     # the small model shipped with hf_tpu
    HF_TPU_SIMULATE=1 python examples/generate.py --model path/to/model "Once upon a time"
"""

import contextlib
import os
import sys

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # harmless on a TPU VM: hf_tpu loads torch_tpu itself

from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tpu

if hf_tpu.runtime.detect().mode == "none":
    hf_tpu.sim.enable()  # no TPU here: use the simulated device
hf_tpu.enable("generation")

args = sys.argv[1:]
if args[:1] == ["--model"]:  # the spelling hf-tpu generate and the other examples use
    args = args[1:]
if args:
    path = args[0]
else:
    from hf_tpu.assets import default_model_path

    path = default_model_path()
prompts = args[1:] or ["The king said", "What light through yonder window"]

tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
model = AutoModelForCausalLM.from_pretrained(path).to("tpu")

# Compile every prompt bucket up to 32 tokens for this batch size ahead of time (progress bar).
print(hf_tpu.warmup(model, max_prompt_len=32, batch_sizes=[len(prompts)], max_new_tokens=32))

inputs = tokenizer(prompts, return_tensors="pt", padding=True)  # stays on the host: hf_tpu moves what it needs
simulated = hf_tpu.runtime.is_simulated()
with hf_tpu.sim.stats() if simulated else contextlib.nullcontext() as counters:
    out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
for text in tokenizer.batch_decode(out, skip_special_tokens=True):
    print("->", text)
if simulated:
    print(f"compiles after warm-up: {counters.compiles}; device->host copies: {counters.d2h_copies} for 32 steps")
