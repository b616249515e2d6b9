"""The kernel's Pallas forms multiply float32 operands at float32 precision on a TPU (issue #67).

A Mosaic matmul of float32 operands without a precision runs one bfloat16 pass (2e-3 off on a v5e). The visit and
decode forms ask for ``Precision.HIGHEST`` in their own ``dot_general``; JAX's megablox ``gmm`` passes none, and a
float32 Qwen3-MoE whose batch-4 decode graph ran that form (hf_tpu's measured choice at 4 tokens of a Mixtral-like
layer) gave other greedy tokens than the CPU on a v5e; the kernel's ``"dense"`` implementation (XLA einsums) had the
same default. On a CPU, interpret mode computes in float32 whatever the
precision, so the tests read what the chip compiles: the Mosaic kernels of the program exported for the TPU
platform (as TorchTPU's ``jax_op`` exports it), each ``tpu.matmul`` and its ``contract_precision``.
"""

from __future__ import annotations

import base64
import re

import pytest
import torch

from ragged_helpers import experts_reference, jax_kernels, make_experts

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _mosaic_matmuls(exported_text: str) -> list[str]:
    """The ``tpu.matmul`` ops of every Mosaic kernel in an exported program, as MLIR text lines."""
    from jax._src.lib import tpu
    from jax._src.lib.mlir import ir

    bodies = re.findall(r'\\22body\\22: \\22([A-Za-z0-9+/=]+)', exported_text)
    assert bodies, "no Mosaic kernel in the exported program"
    lines = []
    for body in bodies:
        ctx = ir.Context()
        tpu.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(base64.b64decode(body), ctx)
        lines += [line for line in str(module).splitlines() if "tpu.matmul" in line]
    return lines


def _export_experts(jk, implementation: str, dtype, tokens: int = 4):
    import jax
    import jax.numpy as jnp
    from jax import export

    # the chip's tiny Qwen3-MoE layer (scripts/chip_torch_tpu.py): 8 experts, top-2, hidden 256, intermediate 256
    hidden, inter, experts = 256, 256, 8
    args = (
        jnp.ones((tokens, hidden), dtype), jnp.zeros((tokens, 2), jnp.int32), jnp.ones((tokens, 2), dtype),
        jnp.ones((experts, 2 * inter, hidden), dtype), jnp.ones((experts, hidden, inter), dtype),
    )  # fmt: skip

    def fn(*a):
        return jk.moe_experts(*a, rhs_transposed=True, implementation=implementation)

    return export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()


@pytest.mark.parametrize("implementation", ["megablox", "pallas_decode", "pallas"])
def test_float32_experts_matmuls_ask_for_float32_precision(kernel, implementation):
    import jax.numpy as jnp

    matmuls = _mosaic_matmuls(_export_experts(jax_kernels(kernel), implementation, jnp.float32))
    assert len(matmuls) >= 2  # gate-up and down
    for line in matmuls:
        assert "contract_precision<fp32>" in line, f"{implementation}: a float32 Mosaic matmul at its default: {line}"


def _xla_dots(exported_text: str) -> list[str]:
    return [line for line in exported_text.splitlines() if "stablehlo.dot_general" in line]


def test_float32_dense_experts_dots_ask_for_float32_precision(kernel):
    """The kernel's ``"dense"`` implementation is XLA einsums, whose float32 default on a TPU is one bfloat16 pass
    too (4.8e-3 off on a v5e): each of its dots asks for ``HIGHEST``."""
    import jax
    import jax.numpy as jnp
    from jax import export

    jk = jax_kernels(kernel)
    dots = _xla_dots(_export_experts(jk, "dense", jnp.float32))
    assert len(dots) >= 4  # gate-up, down, the routing weights, the combine
    for line in dots:
        assert "HIGHEST" in line, f"dense: a float32 XLA dot at its default precision: {line.strip()}"
    args = (jnp.ones((8, 256)), jnp.ones((8, 512, 256)), jnp.array([2, 0, 3, 0, 0, 3, 0, 0], jnp.int32))
    text = export.export(jax.jit(lambda a, b, c: jk.ragged_dot_dense(a, b, c, rhs_transposed=True)),
                         platforms=["tpu"])(*args).mlir_module()  # fmt: skip
    assert _xla_dots(text) and all("HIGHEST" in line for line in _xla_dots(text))


def test_float32_megablox_ragged_dot_asks_for_float32_precision(kernel):
    """``implementation="megablox"`` of the plain grouped matmul too (``ragged_dot_megablox``)."""
    import jax
    import jax.numpy as jnp
    from jax import export

    jk = jax_kernels(kernel)
    args = (jnp.ones((8, 256)), jnp.ones((8, 512, 256)), jnp.array([2, 0, 3, 0, 0, 3, 0, 0], jnp.int32))
    text = export.export(jax.jit(lambda a, b, c: jk.ragged_dot_megablox(a, b, c, rhs_transposed=True)),
                         platforms=["tpu"])(*args).mlir_module()  # fmt: skip
    matmuls = _mosaic_matmuls(text)
    assert matmuls and all("contract_precision<fp32>" in line for line in matmuls)


def test_bfloat16_keeps_the_default_precision(kernel):
    """bfloat16 operands are exact in one pass: the megablox and dense forms leave their products at the default."""
    import jax.numpy as jnp

    text = _export_experts(jax_kernels(kernel), "megablox", jnp.bfloat16)
    matmuls = _mosaic_matmuls(text)
    assert matmuls and not any("contract_precision" in line for line in matmuls)
    dense = _export_experts(jax_kernels(kernel), "dense", jnp.bfloat16)
    assert not any("HIGHEST" in line for line in _xla_dots(dense))


def test_megablox_form_at_the_chip_batch4_shapes_equals_the_cpu(kernel):
    """The megablox form's body (interpret mode) at the shapes of the chip's batch-4 decode (4 tokens) and padded
    prefill (64 rows): tokens routed to one expert, both slots to the same expert, empty groups, against a float64
    loop over the chosen experts."""
    module = make_experts(8, hidden=256, intermediate=256, seed=3)
    forward = kernel.make_experts_forward("megablox_interpret")
    g = torch.Generator().manual_seed(0)
    for tokens in (4, 64):
        hidden = torch.randn(tokens, 256, generator=g)
        index = torch.randint(0, 8, (tokens, 2), generator=g)
        index[0] = 3  # both slots of one token to one expert
        index[1:3, 0] = 5  # several tokens to one expert; some experts get no token at all at 4 tokens
        weights = torch.rand(tokens, 2, generator=g)
        with torch.no_grad():
            got = forward(module, hidden, index, weights)
        want = experts_reference(module, hidden, index, weights)
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6 * want.abs().max().item())
