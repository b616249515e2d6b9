"""Run PyTorch's OpInfo float32 samples on CPU and on the simulated tpu; print one JSON line per op.

Usage: python tests/sim/_opinfo_worker.py START STOP   (indices into the filtered op list)
       python tests/sim/_opinfo_worker.py --count
Used by test_opinfo.py, which runs chunks in subprocesses so that a crash cannot take the test run down.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import warnings

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

import hf_tpu.sim

hf_tpu.sim.enable()
torch.set_num_threads(1)
warnings.filterwarnings("ignore")

SEED = 1234


def _skipped_for_compare_cpu(op) -> bool:
    """PyTorch itself skips these in TestCommon.test_compare_cpu (uninitialised memory, undefined results)."""
    for d in op.decorators:
        if getattr(d, "test_name", None) != "test_compare_cpu" or not d.active_if:
            continue
        if d.device_type not in (None, "privateuse1", "tpu"):
            continue
        if d.dtypes is not None and torch.float32 not in d.dtypes:
            continue
        return True
    return False


def ops():
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if torch.float32 in op.supported_dtypes("cpu") and not _skipped_for_compare_cpu(op)]


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu() if x.device.type == "tpu" else x
    if isinstance(x, torch.device) and x.type == "tpu":
        return torch.device("cpu")
    if isinstance(x, str) and x.startswith("tpu"):
        return "cpu"
    return x


def _compare(got, ref):
    if isinstance(ref, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise TypeError(f"expected a tensor, got {type(got).__name__}")
        # PyTorch's TestCommon.test_compare_cpu tolerances (atol = rtol = 1e-3)
        torch.testing.assert_close(
            got.cpu(), ref, equal_nan=True, check_stride=False, atol=1e-3, rtol=1e-3, check_device=False
        )
        return
    if isinstance(ref, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(ref), "structure differs"
        for g, r in zip(got, ref, strict=True):
            _compare(g, r)
        return
    if isinstance(ref, float) and isinstance(got, float) and math.isnan(ref) and math.isnan(got):
        return
    assert got == ref, f"{got!r} != {ref!r}"


_REFUSED = re.compile(r"^operator '(aten::[\w.]+)' is not implemented for TPU\. Please file a feature request")


def _outcome(e: Exception) -> str:
    """How a sample that does not equal the CPU's failed: ``refused:aten::op`` (torch_tpu's missing-op error),
    ``sparse`` (the simulator's refusal of sparse layouts, as torch_tpu's TpuSparseOpFallback), or ``differs``."""
    text = str(e)
    found = _REFUSED.match(text)
    if isinstance(e, RuntimeError) and found:
        return f"refused:{found.group(1)}"
    if isinstance(e, NotImplementedError) and "simulated tpu device (torch_tpu supports strided tensors only)" in text:
        return "sparse"
    return "differs"


def run_op(op):
    """Like PyTorch's TestCommon.test_compare_cpu: samples made on the device, the same samples moved to CPU.

    Each failure is ``(sample index, outcome, message)``; a sample whose move to the CPU fails is a failure (that is
    the simulator's doing), a sample whose CPU run fails is not counted, as in PyTorch's test.
    """
    res = {
        "op": op.name + (f".{op.variant_test_name}" if op.variant_test_name else ""),
        "cpu_ok": 0,
        "equal": 0,
        "failures": [],
    }
    try:
        torch.manual_seed(SEED)
        samples = list(op.sample_inputs("tpu", torch.float32, requires_grad=False))
    except Exception as e:  # noqa: BLE001
        torch.manual_seed(SEED)
        n = sum(1 for _ in op.sample_inputs("cpu", torch.float32, requires_grad=False))
        res["cpu_ok"] = n
        res["failures"].append((-1, _outcome(e), f"making samples on tpu: {type(e).__name__}: {e}"[:300]))
        return res
    for i, s in enumerate(samples):
        try:
            cs = s.transform(_to_cpu)
        except Exception as e:  # noqa: BLE001 -- the sample exists on the device but cannot be read back
            res["cpu_ok"] += 1
            res["failures"].append((i, _outcome(e), f"moving the sample to the CPU: {type(e).__name__}: {e}"[:300]))
            continue
        try:
            torch.manual_seed(SEED)
            ref = cs.output_process_fn_grad(op(cs.input, *cs.args, **cs.kwargs))
        except Exception:  # noqa: BLE001, S112 - PyTorch's test counts only samples that run on CPU
            continue
        res["cpu_ok"] += 1
        try:
            torch.manual_seed(SEED)
            got = s.output_process_fn_grad(op(s.input, *s.args, **s.kwargs))
            _compare(got, ref)
            res["equal"] += 1
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")[:300]
            res["failures"].append((i, _outcome(e), msg))
    return res


def main():
    if sys.argv[1] == "--count":
        print(len(ops()))
        return
    start, stop = int(sys.argv[1]), int(sys.argv[2])
    selected = ops()[start:stop]
    for op in selected:
        print(json.dumps(run_op(op)), flush=True)


if __name__ == "__main__":
    main()
