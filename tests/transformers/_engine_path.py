"""Run in a process of its own by test_engine_path.py: a text-only greedy ``generate`` of a tiny Llama on the
simulated device, traced from hf_tpu's entry to its first compiled graph (``hf_tpu.transformers._graphs.run_graph``).
With ``--warmed`` (issue #66's measure): the model's graphs compiled by a first ``generate``, the second traced until
Dynamo runs its first compiled frame (the first call into ``torch/_dynamo/eval_frame.py``), every Python call counted.
Prints one JSON object: each hf_tpu file whose functions ran, with those functions' names.

Counted: functions (and comprehensions) of hf_tpu's files, not module or class bodies (a lazy import's first
execution) and not ``hf_tpu/sim`` (the simulated device's ops: on a chip torch_tpu answers them)."""

import inspect
import json
import os
import sys
import tempfile

import torch
import transformers

import hf_tpu

hf_tpu.sim.enable()
config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
torch.manual_seed(0)
path = tempfile.mkdtemp()
transformers.LlamaForCausalLM(config).save_pretrained(path)
model = transformers.AutoModelForCausalLM.from_pretrained(path).eval().to("tpu")
ids = torch.randint(1, 128, (1, 5))
root = os.path.dirname(hf_tpu.__file__)
warmed = "--warmed" in sys.argv
eval_frame = os.path.join(os.path.dirname(torch.__file__), "_dynamo", "eval_frame.py")
files: dict[str, set[str]] = {}
reached = []


def profile(frame, event, arg):
    if reached or event != "call":
        return
    code = frame.f_code
    if warmed and code.co_filename == eval_frame:
        reached.append(True)
        return
    if not code.co_filename.startswith(root) or not code.co_flags & inspect.CO_OPTIMIZED:
        return
    name = os.path.relpath(code.co_filename, root)
    if name.startswith("sim" + os.sep):
        return
    files.setdefault(name, set()).add(code.co_name)
    if not warmed and name == os.path.join("transformers", "_graphs.py") and code.co_name == "run_graph":
        reached.append(True)


with hf_tpu.enabled("generation"):
    if warmed:
        model.generate(ids, max_new_tokens=2, do_sample=False)
    sys.setprofile(profile)
    try:
        model.generate(ids, max_new_tokens=2, do_sample=False)
    finally:
        sys.setprofile(None)
print(json.dumps({"reached_a_graph": bool(reached), "files": {k: sorted(v) for k, v in sorted(files.items())}}))
