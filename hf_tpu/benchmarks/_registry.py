"""The benchmarks' registry: :data:`BENCHMARKS` (each benchmark's name, summary and optional packages, listed without
importing them) and :func:`load`. :mod:`hf_tpu.benchmarks` re-exports every name; import them from there."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

from hf_tpu.errors import UnknownNameError

__all__ = ["BENCHMARKS", "Benchmark", "load", "missing_requirements"]


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: its summary and the optional packages it needs (module name, how to install it)."""

    name: str
    summary: str
    requires: tuple[tuple[str, str], ...] = ()


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("sim_forward", "tiny-Llama forward: simulated tpu vs CPU, time ratio (simulator overhead)"),
        Benchmark(
            "generate",
            "generate: upstream transformers vs hf_tpu: compiles, host<->device copies per decode step, warm-up",
        ),
        Benchmark(
            "sampling",
            "sampling per decode step: host vs device path, greedy vs Qwen3's defaults, batch 1/16/64: copies, bytes",
        ),
        Benchmark(
            "compile_cache",
            "compile cache: warm-up cold vs from the cache (fresh processes), ladder padding/unused cache, decode cost",
        ),
        Benchmark(
            "moe",
            "MoE experts layer: ragged-dot kernel vs eager loop vs grouped_mm: new shapes, ops, CPU time",
            requires=(("jax", "pip install 'hf-tpu[kernels]'"),),
        ),
        Benchmark(
            "diffusion",
            "diffusers pipeline: eager vs compile_pipeline vs warmed up: compiles and time per call",
            requires=(("diffusers", "pip install diffusers"),),
        ),
        Benchmark(
            "arch_sweep",
            "every causal-LM architecture: fast path or why not, identical to CPU, compiles, signatures, copies",
        ),
        Benchmark(
            "vlm_sweep",
            "every image-text-to-text architecture: hf_tpu's loop or why not, identical to CPU, compiles after warm-up",
        ),
        Benchmark(
            "arch_compile",
            "every fast-path architecture's decode program compiled for v6e-1 by libtpu (no TPU): compiles, est. step",
            requires=(("torch_tpu", "pip install 'hf-tpu[tpu]'"),),
        ),
        Benchmark(
            "diffusers_sweep",
            "every diffusers pipeline family (tiny, local): CPU vs tpu eager vs compile_pipeline, compiles per call",
            requires=(("diffusers", "pip install diffusers"),),
        ),
        Benchmark(
            "quant",
            "quantized generate: bf16 vs int8 vs int4 (torchao): weight bytes, peak memory, decode time per step",
            requires=(("torchao", "pip install 'hf-tpu[quant]'"),),
        ),
        Benchmark(
            "serve",
            "hf-tpu serve: Poisson trace vs one at a time (throughput, TTFT, compiles after warm-up); --soak: mixed load",
            requires=(("fastapi", "pip install 'hf-tpu[serve]'"), ("prometheus_client", "pip install 'hf-tpu[serve]'")),
        ),
        Benchmark(
            "encoders",
            "BERT-like encoder inference: eager vs torch.compile vs hf_tpu's buckets (warmed): sentences/s, compiles",
        ),
        Benchmark(
            "ray_batch",
            "Ray Data batch inference (HfTpuGenerate): rows/s on 2 vs 1 simulated TPU VMs, actor start with/without cache",
            requires=(("ray", "pip install 'hf-tpu[ray]'"),),
        ),
        Benchmark(
            "grammar_backends",
            "structured output: llguidance vs xgrammar: compile, tokenizer prep, mask step at batch 1/32, footprint",
        ),
        Benchmark(
            "structured_output",
            "structured output in continuous batching: tokens/s with vs without a JSON schema at 1 and 32 requests",
            requires=(("llguidance", "pip install 'hf-tpu[serve]'"),),
        ),
        Benchmark(
            "training",
            "training steps: eager vs compiled, buckets vs pad-to-longest: steps/s and compiles per step",
        ),
    )
}


def missing_requirements(name: str) -> list[str]:
    """Why benchmark ``name`` cannot run here: one line per missing optional package (empty when it can).

    Example:
        >>> missing_requirements("sim_forward")
        []
    """
    return [
        f"{module} is not installed ({fix})"
        for module, fix in BENCHMARKS[name].requires
        if importlib.util.find_spec(module) is None
    ]


def load(name: str) -> ModuleType:
    """Import benchmark ``name`` (a key of :data:`BENCHMARKS`); raises ``KeyError`` naming the known ones."""
    if name not in BENCHMARKS:
        raise UnknownNameError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    return importlib.import_module(f"{__package__}.{name}")
