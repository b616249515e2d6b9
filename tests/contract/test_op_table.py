"""hf_tpu/sim/_torch_tpu_ops.py equals what torch-tpu 0.2.0's dispatcher and glue library say, regenerated here.

The simulator refuses the ops that reach torch_tpu's ``TpuMissingOpFallback`` and follows its autocast policy; both
come from that table. This test rebuilds it in CI's torch-tpu environment (torch_tpu autoloaded, no chip needed) with
the same script that wrote it, and compares the texts.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("torch_tpu_op_table", REPO / "scripts" / "torch_tpu_op_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_op_table_equals_the_one_regenerated_from_the_wheel():
    assert "torch_tpu" in sys.modules and hasattr(torch, "tpu"), "run with TORCH_DEVICE_BACKEND_AUTOLOAD=1"
    script = _script()
    groups = script.classify()
    shipped = script.TABLE.read_text()
    assert script.render(groups) == shipped, f"rerun: {script.COMMAND}"
    # spot checks of what the table says, straight from the dispatcher
    for op in ("median", "_int_mm", "_weight_int8pack_mm", "_scaled_dot_product_flash_attention_for_cpu"):
        assert "[backend fallback]" in torch._C._dispatch_dump_table(f"aten::{op}").split("PrivateUse1:")[1].split(
            "\n"
        )[0]
    assert len(groups["missing"]) == 402 and len(groups["kernel"]) == 674 and len(groups["composite"]) == 2035


def test_the_refusal_message_is_the_glue_librarys():
    import torch_tpu

    version = torch.__version__.split("+")[0].replace(".", "_")
    (glue,) = (Path(torch_tpu.__file__).parent / "csrc" / "common" / f"glue_{version}").glob("*common.so")
    data = glue.read_bytes()
    assert b"operator '\x00" in data
    assert b"' is not implemented for TPU. Please file a feature request\x00" in data
    assert b"' is not implemented for TPU. Falling back to CPU\x00" in data
    from torch_tpu._internal import execution_mode

    assert execution_mode.enable_cpu_fallback is False


def test_the_modules_chip_init_imports_register_no_aten_kernel():
    """``_loader._init_device_impl`` (run only where chips are) imports these modules: they change no entry."""
    import importlib

    script = _script()
    before = script.classify()
    for module in (
        "torch_tpu._internal.compile",
        "torch_tpu._internal.sync",
        "torch_tpu._internal.pooling.patch",
        "torch_tpu._internal.distributed.torchcomm_tpu",
    ):
        importlib.import_module(module)
    assert script.classify() == before
