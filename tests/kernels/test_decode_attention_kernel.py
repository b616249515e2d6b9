"""The decode-attention-tpu Hub kernel (hf_tpu/kernels/hub/decode-attention-tpu): its torch reference equals torch's
sdpa on the CPU over left-padded and ragged caches, its Pallas kernel (run by JAX's interpreter) equals the reference
and skips the blocks outside each row's filled slots, and it loads through ``kernels`` like the ragged-dot kernel."""

from __future__ import annotations

import importlib

import pytest
import torch

import hf_tpu.sim
from hf_tpu.kernels import DECODE_ATTENTION_REPO, load_decode_attention_kernel


@pytest.fixture(scope="module")
def kernel():
    return load_decode_attention_kernel()


@pytest.fixture(scope="module")
def jk(kernel):
    pytest.importorskip("jax", reason="the kernel's Pallas body runs in JAX: pip install 'hf-tpu[kernels]'")
    return importlib.import_module(f"{kernel.__name__}._jax_kernels")


def _cache(batch, heads, kv_heads, slots, dim, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, slots, dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, slots, dim, generator=g).to(dtype)
    return q, k, v


def _mask(kind, batch, slots, seed=0):
    """(batch, slots) bool: ``left`` a left-padded batch (the rows end at the last slot), ``lengths`` rows filled
    from slot 0 to a length of their own; the first row holds one slot, the last every slot."""
    g = torch.Generator().manual_seed(seed + 1)
    fill = torch.randint(1, slots + 1, (batch,), generator=g)
    fill[0], fill[-1] = 1, slots
    positions = torch.arange(slots)[None, :]
    if kind == "left":
        return positions >= (slots - fill)[:, None]
    return positions < fill[:, None]


def _sdpa(q, k, v, mask, scale=None):
    return torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )


CASES = [(1, 512), (1, 8192), (8, 1024), (8, 8192), (64, 2048), (256, 512), (256, 8192)]  # (batch, slots)


@pytest.mark.parametrize("kind", ["left", "lengths"])
@pytest.mark.parametrize(("batch", "slots"), CASES, ids=lambda v: str(v))
def test_reference_equals_sdpa_on_cpu(kernel, batch, slots, kind):
    heads, kv_heads, dim = (4, 2, 8) if batch * slots <= 2**19 else (2, 1, 4)  # GQA; small heads keep it seconds
    q, k, v = _cache(batch, heads, kv_heads, slots, dim, seed=batch + slots)
    mask = _mask(kind, batch, slots, seed=batch)
    got = kernel.decode_attention(q, k, v, mask)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask), rtol=1e-5, atol=1e-5)
    if kind == "lengths":  # the same rows given as lengths
        lengths = mask.sum(dim=-1)
        torch.testing.assert_close(kernel.decode_attention(q, k, v, lengths, 0.3), _sdpa(q, k, v, mask, 0.3),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


def test_reference_in_bfloat16_and_a_row_without_slots(kernel):
    q, k, v = _cache(3, 8, 2, 640, 32, dtype=torch.bfloat16)
    mask = _mask("left", 3, 640)
    got = kernel.decode_attention(q, k, v, mask)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _sdpa(q, k, v, mask), rtol=2e-2, atol=2e-2)
    mask[1] = False
    empty = kernel.decode_attention(q, k, v, mask)
    assert torch.equal(empty[1], torch.zeros_like(empty[1])) and torch.equal(empty[0], got[0])


def _ragged_rows(slots):
    """A (5, slots) mask whose rows are: one slot, every slot, left-padded, a middle range with a hole, none."""
    mask = torch.zeros(5, slots, dtype=torch.bool)
    mask[0, 0] = True
    mask[1] = True
    mask[2, slots // 3:] = True
    mask[3, 130:250] = True
    mask[3, 140:150] = False
    return mask


def _interpret(jk, q, k, v, mask, scale=None, block=None):
    import jax.numpy as jnp

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    args = [jnp.asarray(t.float().numpy()).astype(jnp.dtype(str(t.dtype).removeprefix("torch."))) for t in (q, k, v)]
    out = jk.decode_attention_pallas(*args, jnp.asarray(mask.numpy()), scale=scale, interpret=True, block=block)
    return torch.from_numpy(jnp.asarray(out, jnp.float32).__array__().copy())


@pytest.mark.parametrize(("heads", "kv_heads", "block"), [(8, 2, 128), (4, 4, 256), (6, 1, None)])
def test_pallas_kernel_interpreted_equals_the_reference(kernel, jk, heads, kv_heads, block):
    """Ragged rows (one slot, full, left-padded, a range with a hole, none), grouped and plain heads, blocks of 128,
    256 and the default (one block of the whole 256-slot cache)."""
    q, k, v = _cache(5, heads, kv_heads, 256, 16, seed=heads)
    mask = _ragged_rows(256)
    want = kernel.reference(q, k, v, mask, 16**-0.5)
    torch.testing.assert_close(_interpret(jk, q, k, v, mask, block=block), want, rtol=1e-5, atol=1e-5)


def test_pallas_kernel_skips_the_blocks_outside_each_rows_slots(kernel, jk):
    """Slots outside a row's first-to-last attended range hold NaN: the kernel neither computes with them nor lets them
    through (the reference, over every slot, would); the rows' filled blocks give the reference's answer."""
    q, k, v = _cache(5, 8, 2, 512, 16, seed=3)
    mask = _ragged_rows(512)
    want = kernel.reference(q, k, v, mask, 16**-0.5)
    for row in range(5):
        valid = mask[row].nonzero()
        lo, hi = (int(valid.min()) // 128 * 128, -(-(int(valid.max()) + 1) // 128) * 128) if len(valid) else (0, 0)
        outside = torch.ones(512, dtype=torch.bool)
        outside[lo:hi] = False
        k[row, :, outside] = float("nan")
        v[row, :, outside] = float("nan")
    got = _interpret(jk, q, k, v, mask, block=128)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pallas_kernel_in_bfloat16_and_a_padded_cache(kernel, jk):
    """bfloat16 operands, and a cache of 2100 slots (no multiple of 128, too long for one block: padded to 2176)."""
    assert jk.block_slots(2100, 16, 2) == 0 and jk.block_slots(2176, 16, 2) == 128
    q, k, v = _cache(2, 4, 2, 2100, 16, seed=7, dtype=torch.bfloat16)
    mask = torch.arange(2100)[None, :] >= torch.tensor([[5], [2000]])
    want = kernel.reference(q, k, v, mask, 0.25)
    got = _interpret(jk, q, k, v, mask, scale=0.25)
    torch.testing.assert_close(got, want.float(), rtol=2e-2, atol=2e-2)


def test_the_op_runs_each_implementation_where_the_tensors_are(kernel, jk):
    """On the CPU and on the simulated tpu: ``auto`` is the reference; ``pallas_interpret`` and ``xla`` run in JAX on
    the host (a simulated tensor through its host view) and agree; ``pallas`` needs TorchTPU's device."""
    hf_tpu.sim.enable()
    q, k, v = _cache(5, 8, 2, 256, 16, seed=11)
    mask = _ragged_rows(256)
    want = kernel.reference(q, k, v, mask, 16**-0.5)
    for device in ("cpu", "tpu"):
        args = [t.to(device) for t in (q, k, v, mask)]
        for implementation in ("auto", "reference", "pallas_interpret", "xla"):
            got = kernel.decode_attention(*args, implementation=implementation)
            assert got.device.type == device
            torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5, msg=f"{device} {implementation}")
        with pytest.raises(ValueError, match="compiles a TPU \\(Mosaic\\) kernel"):
            kernel.decode_attention(*args, implementation="pallas")
    with pytest.raises(ValueError, match="lengths_or_mask must be integer lengths"):
        kernel.decode_attention(q, k, v, mask.float())


def test_get_kernel_loads_it_from_the_hub_folder(kernel):
    """hf_tpu's loader (``kernels.get_local_kernel`` with the torch-tpu variant selected) and plain ``kernels`` on the
    simulator (which kernels detects as tpu) load the package from hf_tpu/kernels/hub/decode-attention-tpu; the op is
    registered once per build."""
    from kernels import get_local_kernel

    assert kernel.__file__.endswith("build/torch-tpu/decode_attention_tpu/__init__.py")
    assert str(DECODE_ATTENTION_REPO) in kernel.__file__
    hf_tpu.sim.enable()
    again = get_local_kernel(DECODE_ATTENTION_REPO)
    assert again.OP_NAMESPACE == kernel.OP_NAMESPACE and again.decode_attention_op is kernel.decode_attention_op
