"""Compile for a real TPU on any host: torch_tpu's own lowering and libtpu's compiler, without a chip.

hf_tpu's graphs (generate's prefill and decode, and any code an entry runs) go through torch_tpu's real front end
(Dynamo, AOTAutograd, torch_tpu's split/static compilers and ``fx_to_mlir``) in a child process where only what
needs a chip is stood in for (:func:`hf_tpu._torch_tpu.start_lowering`), and each StableHLO program is compiled by
libtpu for a described TPU (``v6e-1``, ``v5e-1``, ``v6e-4``, ``v5p-4``, ``tpu7x-4``, ...). The compiler's own
figures (HBM by kind, FLOPs, bytes accessed) then say what a chip would spend: :func:`plan_generate` and
``hf-tpu plan`` turn them into a table a person reads in seconds (:func:`plan_pipeline`, ``hf-tpu plan --pipeline``:
a diffusers pipeline's denoiser step). Every projected time is an estimate from the
compiler's counts and the chip's published bandwidth, never a measurement. See docs/planning.md.

Needs torch-tpu 0.2.0 with libtpu and jax (``pip install 'hf-tpu[tpu]'``); nothing here is imported by
``import hf_tpu``.

An unknown attribute raises the built-in ``AttributeError`` from the module's ``__getattr__`` (the protocol
``hasattr`` and ``getattr`` with a default rely on), not an hf_tpu error.

Example:
    >>> from hf_tpu.tpu_compile import plan_generate                                     # doctest: +SKIP
    >>> plan = plan_generate("path/to/config-dir", target="v6e-1", max_prompt_len=2048)    # doctest: +SKIP
    >>> plan.fits, plan.hbm["weights"]                                                   # doctest: +SKIP
"""

from hf_tpu.tpu_compile.programs import (
    LoweringResult,
    ProgramRecord,
    compile_lowered,
    lower_and_compile,
    lower_and_compile_each,
)
from hf_tpu.tpu_compile.targets import TARGETS, Target, UnknownTargetError, target

__all__ = [
    "TARGETS",
    "LoweringResult",
    "Plan",
    "ProgramRecord",
    "Target",
    "UnknownTargetError",
    "compile_lowered",
    "lower_and_compile",
    "lower_and_compile_each",
    "lower_generate",
    "plan_generate",
    "plan_pipeline",
    "target",
]


def __getattr__(name: str):
    if name in ("Plan", "plan_generate", "plan_pipeline"):
        from hf_tpu.tpu_compile import plan

        return getattr(plan, name)
    if name == "lower_generate":  # generate's own programs, lowered (arch_compile, the plan)
        from hf_tpu.tpu_compile import _generate

        return _generate.lower_generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
