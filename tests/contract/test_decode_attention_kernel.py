"""The decode-attention-tpu Hub kernel against torch-tpu 0.2.0's own Python and libtpu's compiler (no chips).

- Its op registers through the real ``torch.tpu.pallas.jax_op``: the schema TorchTPU derives from the JAX function's
  annotations, and a fake implementation that exports the Pallas kernel for the TPU platform (Mosaic lowering) and
  answers the output's shape, for decode shapes of batch 1 to 256 and caches of 512 to 8192 slots.
- The kernel's own entry point hands tensors TorchTPU owns (stood in by meta tensors) to that op with
  ``implementation="auto"`` resolved to the Pallas kernel.
- The exported programs compile with libtpu's compile-only client for a described v5e and v6e chip
  (``python -m hf_tpu.tpu_compile._xla``, as the compile tier does).

What only a chip can show (TorchTPU running the exported program, its speed) is listed in docs/kernels.md.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

# JAX would otherwise probe libtpu (installed with torch-tpu) for a TPU backend on first use; the exports below need
# none. Set before jax is imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest
import torch

from hf_tpu.kernels import load_decode_attention_kernel

SCHEMA = "(Tensor query, Tensor key, Tensor value, Tensor mask, float scale, str implementation) -> Tensor"
#: (batch, heads, kv_heads, slots, head_dim, dtype): Llama-3-8B's attention (32 heads, 8 KV heads, 128) over caches of
#: 512 to 8192 slots at batch 1 to 256, a head_dim of 64 in float32, and a cache no multiple of 128 (padded)
SHAPES = [
    (1, 32, 8, 512, 128, "bfloat16"),
    (8, 32, 8, 2048, 128, "bfloat16"),
    (64, 32, 8, 640, 128, "bfloat16"),
    (256, 32, 8, 8192, 128, "bfloat16"),
    (4, 14, 2, 1024, 64, "float32"),
    (2, 32, 8, 3000, 128, "bfloat16"),
]


@pytest.fixture(scope="module")
def kernel():
    return load_decode_attention_kernel()


@pytest.fixture(scope="module")
def ops(kernel):
    return importlib.import_module(f"{kernel.__name__}._ops")


@pytest.fixture(scope="module")
def jk(kernel):
    return importlib.import_module(f"{kernel.__name__}._jax_kernels")


def test_the_op_registers_through_the_real_jax_op(ops):
    from torch_tpu._internal.pallas import pallas as tt_pallas

    op = ops.torch_tpu_op()
    assert isinstance(op, tt_pallas._JaxCustomOpDef)  # what jax_op returns: a torch.library.custom_op
    packet = getattr(getattr(torch.ops, ops.OP_NAMESPACE), "decode_attention_tpu")
    assert str(packet.default._schema) == f"{ops.OP_NAMESPACE}::decode_attention_tpu{SCHEMA}"
    assert ops.torch_tpu_op() is op  # once per process


@pytest.mark.parametrize(("batch", "heads", "kv_heads", "slots", "dim", "dtype"), SHAPES[:4], ids=lambda v: str(v))
def test_fake_implementation_exports_the_pallas_kernel_for_tpu(ops, batch, heads, kv_heads, slots, dim, dtype):
    """The real jax_op fake implementation exports ``decode_attention_device`` for the TPU platform and answers
    the output's shape and dtype."""
    torch_dtype = getattr(torch, dtype)
    meta = {"device": "meta", "dtype": torch_dtype}
    out = ops.torch_tpu_op()(
        torch.empty(batch, heads, 1, dim, **meta),
        torch.empty(batch, kv_heads, slots, dim, **meta),
        torch.empty(batch, kv_heads, slots, dim, **meta),
        torch.empty(batch, slots, device="meta", dtype=torch.int32),
        dim**-0.5,
        "pallas",
    )
    assert (tuple(out.shape), out.dtype, out.device.type) == ((batch, heads, 1, dim), torch_dtype, "meta")


def test_the_kernel_hands_tpu_tensors_to_the_jax_op_op(ops, kernel, monkeypatch):
    """As on a TPU VM: tensors TorchTPU owns (stood in by meta tensors, the one thing that needs a chip) go to the
    jax_op-registered op with ``implementation="auto"`` resolved to the Pallas kernel and the mask as int32."""
    calls = []
    op = ops.torch_tpu_op()

    def spy(*args):
        calls.append((args[3].dtype, args[-2:]))
        return op(*args)

    monkeypatch.setattr(ops, "_placement", lambda t: "torch_tpu")
    monkeypatch.setattr(ops, "torch_tpu_op", lambda: spy)
    meta = {"device": "meta", "dtype": torch.bfloat16}
    q, k = torch.empty(16, 32, 1, 128, **meta), torch.empty(16, 8, 1024, 128, **meta)
    out = ops._impl(q, k, k, torch.empty(16, 1024, device="meta", dtype=torch.bool), 0.125, "auto")
    assert tuple(out.shape) == (16, 32, 1, 128) and out.device.type == "meta"
    assert calls == [(torch.int32, (0.125, "pallas"))]


def _exported(jk, batch, heads, kv_heads, slots, dim, dtype) -> str:
    """The StableHLO TorchTPU's jax_op would hand over for the shape: ``jax.export`` for platforms=["tpu"]."""
    exported = jax.export.export(
        jax.jit(jk.decode_attention_device, static_argnums=(4, 5)),
        platforms=["tpu"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ALL")],
    )(
        jax.ShapeDtypeStruct((batch, heads, 1, dim), dtype),
        jax.ShapeDtypeStruct((batch, kv_heads, slots, dim), dtype),
        jax.ShapeDtypeStruct((batch, kv_heads, slots, dim), dtype),
        jax.ShapeDtypeStruct((batch, slots), "int32"),
        dim**-0.5,
        "pallas",
    )
    return exported.mlir_module()


@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
def test_the_exported_kernel_compiles_with_libtpu_for_a_described_chip(jk, tmp_path, topology):
    """Each shape's program holds one Mosaic kernel, and libtpu's compile-only client compiles every one for the
    first chip of ``topology``."""
    from _timeouts import SAFETY_TIMEOUT_S

    from hf_tpu.tpu_compile.programs import child_environment

    texts = [_exported(jk, *shape) for shape in SHAPES]
    assert [t.count("tpu_custom_call") for t in texts] == [1] * len(SHAPES)
    (tmp_path / "in.json").write_text(json.dumps(texts))
    proc = subprocess.run(
        [sys.executable, "-m", "hf_tpu.tpu_compile._xla", str(tmp_path / "in.json"), topology,
         str(tmp_path / "out.json")],
        capture_output=True, text=True, env=child_environment(), timeout=SAFETY_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads((tmp_path / "out.json").read_text())
    assert [r["compiled"] for r in records] == [True] * len(SHAPES), [r.get("error") for r in records]
