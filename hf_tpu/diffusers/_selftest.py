"""Self-test check of diffusers on the TPU (see :mod:`hf_tpu.selftest`): a tiny pipeline, eager and compiled.

On a TPU VM this is the first run of a diffusion pipeline on real chips: a tiny Stable Diffusion pipeline (built by
:func:`hf_tpu.diffusers.testing.tiny_sd_pipeline`, saved and loaded back with ``from_pretrained``) draws one image on
the CPU and on the ``tpu`` device from the same seed (a CPU generator), and the images must agree. Then
:func:`hf_tpu.diffusers.compile_pipeline` compiles the UNet and the pipeline runs twice at the same size: the report
has the wall time of the cold and the warm call, the graphs each compiled (expected: none on the warm call) and the
largest pixel difference from the CPU image.
"""

from __future__ import annotations

import importlib.util
import tempfile
from typing import Any

from hf_tpu.selftest import CheckContext, CheckFailed, SkipCheck, register_check

_PROMPT = "a squirrel"  # within the tiny CLIP's 16 tokens
_SIZE = 32  # the tiny SD VAE divides by 8: 4x4 latents
_STEPS = 2
# float32 on both sides, images in [0, 1] (one 8-bit level is ~4e-3): the tolerance is the float32 matmul
# precision's (hf_tpu.numerics) for a stack of this depth (text encoder, UNet steps, VAE decoder). At a TPU's default,
# 'medium' (one bfloat16 pass), the simulator's image differs by up to 1.3e-2 (of 3.2e-2 allowed), at 'highest' by ~1e-7.
_LAYERS = 8


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@register_check(
    "diffusers",
    description="a tiny SD pipeline on the tpu device matches CPU; compiled UNet, no compile on the second call",
    quick=False,
    order=80,
)
def _diffusers(ctx: CheckContext) -> dict[str, Any]:
    if importlib.util.find_spec("diffusers") is None:
        raise SkipCheck("diffusers is not installed: pip install 'diffusers>=0.35' (a dependency of hf-tpu)")
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    from hf_tpu._patch import enabled
    from hf_tpu.diffusers.compile import compile_pipeline, compiled_modules
    from hf_tpu.diffusers.testing import tiny_sd_pipeline

    def draw(pipe: Any) -> np.ndarray:
        generator = torch.Generator("cpu").manual_seed(0)
        out = pipe(
            _PROMPT,
            height=_SIZE,
            width=_SIZE,
            num_inference_steps=_STEPS,
            generator=generator,
            output_type="np",
        )
        return np.asarray(out.images)  # on the host: the timing includes the device's work

    def compare(label: str, image: np.ndarray, expected: np.ndarray) -> None:
        figures[f"{label}_max_abs_diff"] = float(np.abs(image - expected).max())
        ctx.compare(torch.from_numpy(image), torch.from_numpy(expected), figures, layers=_LAYERS,
                    what=f"the {label} image")  # fmt: skip

    figures: dict[str, Any] = {"size": f"{_SIZE}x{_SIZE}", "steps": _STEPS}
    with tempfile.TemporaryDirectory(prefix="hf_tpu_selftest_") as path:
        tiny_sd_pipeline(path)
        cpu_pipe = DiffusionPipeline.from_pretrained(path)
        cpu_pipe.set_progress_bar_config(disable=True)
        expected = draw(cpu_pipe)
        del cpu_pipe
        pipe = DiffusionPipeline.from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        with enabled("diffusers"):
            pipe = pipe.to(ctx.device)
            with ctx.measure(figures, "eager"):
                image = draw(pipe)
            compare("eager", image, expected)

            compile_pipeline(pipe)
            figures["compiled"] = ",".join(compiled_modules(pipe))
            for label in ("cold", "warm"):
                before = _graphs_compiled()
                with ctx.measure(figures, label):
                    image = draw(pipe)
                figures[f"{label}_graphs"] = _graphs_compiled() - before
                compare(label, image, expected)
    if ctx.simulated and figures["warm_compiles"]:
        raise CheckFailed(
            f"warm_compiles={figures['warm_compiles']}: the second compiled call at {_SIZE}x{_SIZE} compiled again "
            "(expected 0)"
        )
    return figures
