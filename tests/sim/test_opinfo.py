"""PyTorch's OpInfo float32 samples give the same results on the simulated tpu as on the CPU, or are refused as a chip
refuses them.

The comparison is PyTorch's own ``TestCommon.test_compare_cpu`` (samples made on the device, the same samples
moved to the CPU, ``output_process_fn_grad`` applied, atol = rtol = 1e-3, ops PyTorch skips there skipped).
Ops run in worker subprocesses, so that a crash cannot take the test run down: a crashed op is reported as a
failure and the worker resumes after it.

Every sample equals the CPU's, except the ones pinned below: :data:`EXPECTED_REFUSALS` lists, per OpInfo op, the
aten ops torch-tpu 0.2.0 sends to its missing-op fallback (hf_tpu/sim/_torch_tpu_ops.py) that its samples reach,
so on a chip they raise "operator '...' is not implemented for TPU" too (sparse conversions included: a dense tpu
tensor's ``to_sparse`` reaches ``aten::_to_sparse``, which torch_tpu lacks). :data:`KNOWN_DIFFERENCES` (empty)
would list the simulator's own gaps, each with its reason. Any other difference, a missing refusal or a new one,
fails the test.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu.sim import _torch_tpu_ops

WORKER = Path(__file__).with_name("_opinfo_worker.py")
ROOT = Path(__file__).resolve().parents[2]
# OpInfo op -> the refused aten ops (torch_tpu's names, without "aten::") its float32 samples reach
EXPECTED_REFUSALS = {
    "_batch_norm_with_update": {"_batch_norm_with_update"},
    "_upsample_bilinear2d_aa": {"_upsample_bilinear2d_aa.out"},
    "addbmm": {"addbmm"},
    "cholesky": {"cholesky"},
    "cholesky_inverse": {"linalg_cholesky_ex.L"},
    "cholesky_solve": {"linalg_cholesky_ex.L"},
    "copysign": {"copysign.out"},
    "cross": {"linalg_cross.out"},
    "erfc": {"erfc.out"},
    "frexp": {"frexp.Tensor_out"},
    "hash_tensor": {"hash_tensor.out"},
    "heaviside": {"heaviside.out"},
    "histogram": {"histogram.bin_ct", "histogram.bins_tensor"},
    "histogramdd": {"_histogramdd_bin_edges", "_histogramdd_from_bin_tensors"},
    "hypot": {"hypot.out"},
    "i0": {"i0.out"},
    "igamma": {"igamma.out"},
    "igammac": {"igammac.out"},
    "kthvalue": {"kthvalue.values"},
    "linalg.cholesky": {"linalg_cholesky_ex.L"},
    "linalg.cholesky_ex": {"linalg_cholesky_ex.L"},
    "linalg.cross": {"linalg_cross.out"},
    "linalg.det": {"_linalg_det.result"},
    "linalg.eig": {"linalg_eig"},
    "linalg.eigh": {"_linalg_eigh.eigenvalues"},
    "linalg.eigvals": {"_linalg_eigvals"},
    "linalg.eigvalsh": {"_linalg_eigh.eigenvalues"},
    "linalg.householder_product": {"linalg_householder_product"},
    "linalg.ldl_factor": {"linalg_ldl_factor_ex.out"},
    "linalg.ldl_factor_ex": {"linalg_ldl_factor_ex.out"},
    "linalg.ldl_solve": {"linalg_ldl_factor_ex.out"},
    "linalg.lstsq": {"linalg_lstsq.out"},
    "linalg.lstsq.grad_oriented": {"linalg_lstsq.out"},
    "linalg.matrix_rank.hermitian": {"_linalg_eigh.eigenvalues"},
    "linalg.slogdet": {"_linalg_slogdet.sign"},
    "logaddexp": {"logaddexp.out"},
    "logaddexp2": {"logaddexp2.out"},
    "logdet": {"_linalg_slogdet.sign"},
    "masked.logaddexp": {"logaddexp.out"},
    "masked.median": {"nanmedian.dim_values"},
    "matrix_exp": {"linalg_matrix_exp"},
    "median": {"median", "median.dim_values"},
    "mode": {"mode"},
    "nanmean": {"nansum"},
    "nanmedian": {"nanmedian", "nanmedian.dim_values"},
    "nansum": {"nansum"},
    "nextafter": {"nextafter.out"},
    "nn.functional.adaptive_max_pool3d": {"adaptive_max_pool3d.out"},
    "nn.functional.hardshrink": {"hardshrink.out"},
    "nn.functional.huber_loss": {"huber_loss"},
    "nn.functional.interpolate.trilinear": {"upsample_trilinear3d.out"},
    "nn.functional.max_unpool1d": {"max_unpool2d"},
    "nn.functional.max_unpool1d.grad": {"max_unpool2d"},
    "nn.functional.max_unpool2d": {"max_unpool2d"},
    "nn.functional.max_unpool2d.grad": {"max_unpool2d"},
    "nn.functional.max_unpool3d": {"max_unpool3d"},
    "nn.functional.max_unpool3d.grad": {"max_unpool3d"},
    "nn.functional.mish": {"mish.out"},
    "nn.functional.multi_margin_loss": {"multi_margin_loss"},
    "nn.functional.multilabel_margin_loss": {"multilabel_margin_loss_forward"},
    "nn.functional.smooth_l1_loss": {"smooth_l1_loss.out"},
    "nn.functional.softshrink": {"softshrink.out"},
    "nonzero_static": {"nonzero_static"},
    "ormqr": {"ormqr"},
    "renorm": {"renorm.out"},
    "sinc": {"sinc.out"},
    "sparse.mm.reduce": {"_to_sparse_csr"},
    "sparse.sampled_addmm": {"_to_sparse_csr"},
    "special.airy_ai": {"special_airy_ai.out"},
    "special.bessel_j0": {"special_bessel_j0.out"},
    "special.bessel_j1": {"special_bessel_j1.out"},
    "special.bessel_y0": {"special_bessel_y0.out"},
    "special.bessel_y1": {"special_bessel_y1.out"},
    "special.entr": {"special_entr.out"},
    "special.erfcx": {"special_erfcx.out"},
    "special.i0e": {"special_i0e.out"},
    "special.i1": {"special_i1.out"},
    "special.i1e": {"special_i1e.out"},
    "special.log_ndtr": {"special_log_ndtr.out"},
    "special.modified_bessel_i0": {"special_modified_bessel_i0.out"},
    "special.modified_bessel_i1": {"special_modified_bessel_i1.out"},
    "special.modified_bessel_k0": {"special_modified_bessel_k0.out"},
    "special.modified_bessel_k1": {"special_modified_bessel_k1.out"},
    "special.ndtri": {"special_ndtri.out"},
    "special.scaled_modified_bessel_k0": {"special_scaled_modified_bessel_k0.out"},
    "special.scaled_modified_bessel_k1": {"special_scaled_modified_bessel_k1.out"},
    "special.spherical_bessel_j0": {"special_spherical_bessel_j0.out"},
    "special.xlog1py": {"special_xlog1py.out"},
    "std_mean": {"std_mean.correction"},
    "std_mean.unbiased": {"std_mean.correction"},
    "to_sparse": {"_to_sparse", "_to_sparse.sparse_dim"},
    "trace": {"trace"},
    "triangular_solve": {"triangular_solve.X"},
}  # fmt: skip
# OpInfo op -> why its samples may differ from the CPU's on the simulator (none today)
KNOWN_DIFFERENCES: dict[str, str] = {}


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env.pop("HF_TPU_SIMULATE", None)
    return env


def _run_range(start, stop):
    """Run ops [start, stop); on a crash, record the op and carry on after it."""
    results, crashes = [], []
    while start < stop:
        proc = subprocess.run(
            [sys.executable, str(WORKER), str(start), str(stop)],
            check=False,
            capture_output=True,
            text=True,
            env=_env(),
            timeout=SAFETY_TIMEOUT_S,
        )
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        results += lines
        start += len(lines)
        if proc.returncode != 0 and start < stop:
            crashes.append((start, proc.returncode, proc.stderr[-500:]))
            start += 1  # skip the op that took the worker down
    return results, crashes


def _refused_samples(result):
    """Samples refused as on a chip; a refusal while making the samples on the device (index -1) is all of them."""
    if any(f[0] == -1 for f in result["failures"]):
        return result["cpu_ok"]
    return sum(f[1].startswith("refused:") for f in result["failures"])


def test_opinfo_float32_matches_cpu_or_is_refused_as_on_a_chip():
    count = int(
        subprocess.run(
            [sys.executable, str(WORKER), "--count"],
            capture_output=True,
            text=True,
            env=_env(),
            check=True,
            timeout=SAFETY_TIMEOUT_S,
        ).stdout.strip()
    )
    chunks = 2
    bounds = [(i * count // chunks, (i + 1) * count // chunks) for i in range(chunks)]
    with ThreadPoolExecutor(chunks) as pool:
        parts = list(pool.map(lambda b: _run_range(*b), bounds))
    results = [r for part, _ in parts for r in part]
    crashes = [c for _, part in parts for c in part]
    assert not crashes, f"ops crashed the process (op index, returncode, stderr): {crashes}"
    assert len(results) == count, f"only {len(results)} of {count} ops reported"
    total = sum(r["cpu_ok"] for r in results)
    equal = sum(r["equal"] for r in results)
    assert total > 10000, f"too few samples ran on CPU ({total}): the OpInfo harness is broken"

    refused: dict[str, set[str]] = {}
    unexpected = []
    for r in results:
        for index, outcome, message in r["failures"]:
            if outcome.startswith("refused:"):
                refused.setdefault(r["op"], set()).add(outcome.partition(":")[2].removeprefix("aten::"))
            elif r["op"] not in KNOWN_DIFFERENCES:
                unexpected.append(f"  {r['op']} sample {index} ({outcome}): {message[:200]}")
    # a refusal while making the samples on the device (index -1) stands for every sample of the op
    n_refused = sum(_refused_samples(r) for r in results)
    print(f"OpInfo float32: {equal}/{total} samples equal, {n_refused} refused as on a chip, over {len(results)} ops")
    assert not unexpected, "samples that differ from the CPU's:\n" + "\n".join(unexpected)
    table = _torch_tpu_ops.REFUSED | set(_torch_tpu_ops.VIA_OUT.values())
    assert all(op in table for ops in refused.values() for op in ops), "a refusal names an op outside the table"
    missing = {op: sorted(ops) for op, ops in EXPECTED_REFUSALS.items() if refused.get(op) != ops}
    extra = {op: sorted(ops) for op, ops in refused.items() if op not in EXPECTED_REFUSALS}
    assert not missing and not extra, (
        f"refusals changed: expected but not seen as pinned {missing}; seen but not pinned {extra}"
    )
    assert equal + n_refused == total
