"""Tensor-parallel text generation: one process per TPU chip, the model sharded at load time.

Run it through the launcher, which starts one process per chip with torch_tpu's launch environment:

    # on a machine without TPU (each rank gets its own simulated tpu:0):
    hf-tpu launch --simulate --nproc_per_node=4 examples/tp_generate.py --compare
    # on a TPU VM with 4 chips:
    hf-tpu launch --nproc_per_node=4 examples/tp_generate.py --model Qwen/Qwen3-0.6B --prompt "The capital of France"
    # the same without the hf-tpu script:
    python -m hf_tpu.launch --simulate --nproc_per_node=2 examples/tp_generate.py

Without ``--model`` it uses hf_tpu's shipped demo model if present, else a tiny random Llama with 2 KV heads
(so that at 4 ranks hf_tpu has to replicate attention: watch the warning). ``--compare`` also runs the
unsharded model on each rank and checks that the sharded greedy output is token-identical.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

import hf_tpu


def _demo_model(folder: str) -> str:
    """hf_tpu's shipped demo model, or a tiny random Llama saved in ``folder`` (each rank builds the same one)."""
    try:
        from hf_tpu.assets import default_model_path

        return str(default_model_path())
    except (ImportError, FileNotFoundError):
        pass
    from hf_tpu.testing import tiny_model

    path = os.path.join(folder, "tiny-llama-2kv")
    tiny_model("llama", path, vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=8)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder or Hub id (default: the demo model)")
    parser.add_argument("--prompt", default="The king said")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--compare", action="store_true", help="also run the unsharded model and compare")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hf_tpu_tp_demo_") as folder:
        run(args, args.model or _demo_model(folder))


def run(args: argparse.Namespace, path: str) -> None:
    """Load the model sharded over the launched ranks, generate greedily with a static cache, print on rank 0."""
    hf_tpu.enable()  # among others, the tensor-parallel plan checks
    if args.compare:  # greedy tokens compared with the unsharded model's: float32 products, as on a chip
        torch.set_float32_matmul_precision("highest")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.distributed import DistributedConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=world))
    else:  # a single process: no sharding, the whole model on tpu:0
        model = AutoModelForCausalLM.from_pretrained(path).to("tpu")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        inputs = dict(tokenizer(args.prompt, return_tensors="pt"))
    except (OSError, ValueError):  # the random demo model has no tokenizer
        tokenizer, inputs = None, {"input_ids": torch.tensor([[1, 5, 9, 23, 77, 3]])}
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    gen = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "cache_implementation": "static"}
    tokens = model.generate(**inputs, **gen)

    if args.compare:
        reference = AutoModelForCausalLM.from_pretrained(path).to(model.device)
        same = torch.equal(reference.generate(**inputs, **gen).cpu(), tokens.cpu())
        print(f"[rank {rank}] TP={world} greedy output equals the unsharded model's: {same}", flush=True)
    if rank == 0:
        text = tokenizer.decode(tokens[0], skip_special_tokens=True) if tokenizer else tokens[0].tolist()
        print(f"[rank 0] device {model.device}, tp_size={world}: {text}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    if args.compare and not same:
        raise SystemExit(1)  # a shell, CI or the docs' test sees the mismatch, not only the line above


if __name__ == "__main__":
    main()
