"""A compiled VAE decoder through torch_tpu 0.2.0's lowering, without and with hf_tpu's GroupNorm decomposition.

On a v5e, ``compile_pipeline(pipe, vae=True)`` failed for SD3's VAE at 1024x1024: torch_tpu's lowering ran torch's
``math_group_norm`` (torch_tpu has no forward GroupNorm kernel) on the channels-last output of the mid-block
attention's residual, and its ``view`` refused it (``BackendCompilerFailed``). The same happens here with no chip,
for a tiny SD3-shaped VAE decoder; with :mod:`hf_tpu._group_norm`'s decomposition in torch_tpu's table, the decoder
lowers and libtpu compiles it for a v5e. One lowering process for both (the failing one last), one compiling process.
"""

from __future__ import annotations

import os
from pathlib import Path

from hf_tpu import _group_norm, _torch_tpu
from hf_tpu.tpu_compile import lower_and_compile_each

HERE = Path(__file__).resolve().parent
ENTRY = "_tpu_compile_entries:lower_vae_decoder"


def test_the_backend_reads_the_table_hf_tpu_patches_at_each_compile():
    """torch_tpu's backend passes its module's decomposition table to AOTAutograd by name, when it compiles (so a
    table patched after import is the one used). Read from the wheel's source, not imported (its import sets
    environment variables)."""
    module, name = _group_norm.TORCH_TPU_TABLE
    source = (_torch_tpu._package_dir().parent / (module.replace(".", "/") + ".py")).read_text()
    assert f"\n{name} = get_decompositions([" in source
    assert f"decompositions={name}," in source


def test_compiled_vae_decoder_lowers_with_contiguous_group_norm_and_fails_without(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    results = lower_and_compile_each(
        {"fixed": (ENTRY, {"fixed": True}), "torch_tpu": (ENTRY, {"fixed": False})}, "v5e-1"
    )
    fixed, plain = results["fixed"], results["torch_tpu"]

    assert fixed.error is None, f"{fixed.error}\n at {fixed.where}"
    assert "aten.native_group_norm.default" in fixed.info["table"]
    [program] = fixed.programs
    assert program.name == "vae-decoder-16x16" and program.lowered and program.compiled, program.error
    assert program.outputs == [[[1, 3, 32, 32], "bfloat16"]]

    # torch_tpu as it is: the mid-block's second ResNet gets the attention's channels-last residual
    assert "aten.native_group_norm.default" not in plain.info.get("table", [])
    assert plain.error is not None and not any(p.lowered for p in plain.programs)
    assert "view(): cannot create a view of shape [1, 32, 512]" in plain.error, plain.error
    assert "strides [64, 1, 1024, 64]" in plain.error and "native_group_norm" in plain.error, plain.error
