"""The torch side: decode attention as a ``torch.library.custom_op``, and where each implementation runs.

Where the tensors live decides what runs (``implementation="auto"``):

- ``tpu`` under TorchTPU (``torch_tpu``): the Pallas kernel, through TorchTPU's public JAX bridge,
  ``torch.tpu.pallas.jax_op`` (torch-tpu 0.2.0), which registers the JAX function as a ``torch.library.custom_op`` of
  its own; calling that op exports the function for the TPU platform, and TorchTPU compiles and runs it on the
  tensors where they are (see :func:`torch_tpu_op`);
- ``cpu``, or ``tpu`` on hf_tpu's simulated device (a ``tpu`` device over CPU memory, used to test TPU code on hosts
  without one): :func:`reference`, the same attention in torch ops, on the tensors where they are.

``"pallas_interpret"`` and ``"xla"`` run the kernel body under JAX's Pallas interpreter, or the XLA form, in JAX on
the CPU (tensors reach it through DLPack; a simulated tensor through its host view): for testing the kernel's
arithmetic on a host without a TPU.

The op has a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` traces it as one node, with an output
shape that depends on the input shapes only.
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from pathlib import Path

import torch

__all__ = ["IMPLEMENTATIONS", "OP_NAMESPACE", "decode_attention", "decode_attention_op", "reference", "torch_tpu_op"]

IMPLEMENTATIONS = ("auto", "reference", "pallas", "pallas_interpret", "xla")
#: What runs in JAX on the host (CPU tensors, or the simulated device's host views).
_HOST_JAX = ("pallas_interpret", "xla")


def _namespace() -> str:
    # One namespace per kernel build: loading the same build twice (from the Hub cache and from a local checkout)
    # reuses the registered op, and two different builds never collide.
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return f"_decode_attention_tpu_{digest.hexdigest()[:10]}"


OP_NAMESPACE = _namespace()


def _jax():
    try:
        import jax
    except ImportError as exc:  # pragma: no cover - exercised only without jax
        raise ImportError(
            "the decode-attention-tpu kernel runs its Pallas kernel in JAX, but jax is not installed; install it with "
            "`pip install jax` (also on a TPU VM: not 'jax[tpu]', whose libtpu pin conflicts with torch-tpu's)."
        ) from exc
    return jax


def _host_view(t: torch.Tensor) -> torch.Tensor | None:
    """The CPU tensor sharing a *simulated* ``tpu`` tensor's buffer, or None for any other tensor. The kernel does not
    import hf_tpu: it asks the simulator only when it is already loaded (``hf_tpu.sim``)."""
    sim = sys.modules.get("hf_tpu.sim")
    is_sim_tensor = getattr(sim, "is_sim_tensor", None)
    if is_sim_tensor is None or not is_sim_tensor(t):
        return None
    return sim.host_view(t)


def _placement(t: torch.Tensor) -> str:
    """``"cpu"``, ``"sim"`` (hf_tpu's simulated tpu) or ``"torch_tpu"``."""
    if t.device.type == "cpu":
        return "cpu"
    if _host_view(t) is not None:
        return "sim"
    if t.device.type == "tpu":
        return "torch_tpu"
    raise NotImplementedError(
        f"decode_attention_tpu runs on 'tpu' (TorchTPU or hf_tpu's simulator) and 'cpu' tensors; got {t.device}. "
        "Move the tensors to one of those devices."
    )


def _resolve(implementation: str, placement: str) -> str:
    if implementation == "auto":
        return "pallas" if placement == "torch_tpu" else "reference"
    if implementation == "pallas" and placement != "torch_tpu":
        raise ValueError(
            "decode_attention: implementation='pallas' compiles a TPU (Mosaic) kernel, but these tensors live in "
            "host memory (CPU or the simulated device); use 'pallas_interpret' to run the same kernel body there, or "
            "'auto'."
        )
    if implementation in _HOST_JAX and placement == "torch_tpu":
        raise ValueError(
            f"decode_attention: implementation={implementation!r} runs in JAX on the host, but these tensors are on "
            "TorchTPU's device; use 'pallas' or 'auto'."
        )
    return implementation


def reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """The kernel's semantics in torch ops, over every slot: what runs off TorchTPU.

    ``query`` (batch, heads, 1, head_dim), ``key`` / ``value`` (batch, kv_heads, slots, head_dim / v_dim), ``mask``
    (batch, slots) bool -> (batch, heads, 1, v_dim) in the query's dtype; a row with no valid slot gives zeros. The
    scores are summed in float32 from the operands as they are and the softmax taken in float32; the numerator
    ``p / max(p)`` (that is ``exp(s - max)``) is rounded to the value dtype for the second product, summed in float32,
    the normalisation last: a flash kernel's order of arithmetic, and the CPU sdpa kernel's.
    """
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(q.float(), key.float().transpose(-1, -2)) * scale  # (batch, kv_heads, group, slots)
    valid = mask[:, None, None, :]
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    none = torch.zeros((), dtype=probs.dtype, device=probs.device)
    probs = torch.where(valid.any(dim=-1, keepdim=True), probs, none)  # a row without a valid slot: zeros
    top = probs.amax(dim=-1, keepdim=True)
    numerator = (probs / torch.where(top > 0, top, torch.ones_like(top))).to(value.dtype).float()
    out = torch.matmul(numerator, value.float()) * top
    return out.to(query.dtype).reshape(batch, heads, 1, value.shape[-1])


def _to_jax(t: torch.Tensor):
    return _jax().dlpack.from_dlpack(t.detach().contiguous())


def _host_jax(implementation: str, query, key, value, mask, scale: float) -> torch.Tensor:
    from . import _jax_kernels as jk

    arrays = [_to_jax(t) for t in (query, key, value, mask.to(torch.int32))]
    return torch.from_dlpack(jk.decode_attention_device(*arrays, scale, implementation))


# The kernel's op registered through TorchTPU's jax_op (one per process)
_TPU_OP: list = []


def _jax_op():
    """``torch.tpu.pallas.jax_op``, TorchTPU's public JAX bridge, or a RuntimeError naming what is missing."""
    tpu = getattr(torch, "tpu", None)
    if tpu is None:
        raise RuntimeError(
            "decode_attention_tpu got tensors on a 'tpu' device, but torch.tpu is missing: TorchTPU (torch_tpu) is "
            "not loaded in this process; install torch-tpu>=0.2.0 (pip install torch-tpu jax), or move the tensors to "
            "the CPU."
        )
    try:
        return tpu.pallas.jax_op
    except ImportError as exc:  # torch_tpu's pallas module imports jax (and absl, frozendict) on first access
        raise RuntimeError(
            f"decode_attention_tpu: torch.tpu.pallas.jax_op (TorchTPU's JAX bridge) failed to import ({exc}); "
            "install jax next to torch-tpu: pip install jax"
        ) from exc
    except AttributeError as exc:
        raise RuntimeError(
            f"decode_attention_tpu needs torch.tpu.pallas.jax_op (TorchTPU's public JAX bridge, torch-tpu 0.2.0), but "
            f"this torch_tpu does not have it ({exc}); install torch-tpu 0.2.x."
        ) from exc


def torch_tpu_op():
    """The kernel's JAX function as a TorchTPU op.

    Registered once per process with ``torch.tpu.pallas.jax_op("<OP_NAMESPACE>::decode_attention_tpu", fn)``: a
    ``torch.library.custom_op`` whose schema TorchTPU derives from the function's annotations (``(Tensor query,
    Tensor key, Tensor value, Tensor mask, float scale, str implementation) -> Tensor``), whose fake implementation
    exports the function for the TPU platform to learn the output's shape, and whose device implementation exports
    it, hands the program to TorchTPU and runs it on the tensors where they are.
    """
    if not _TPU_OP:
        jax_op = _jax_op()
        _jax()
        from torch._library import custom_ops

        from . import _jax_kernels as jk

        qualname = f"{OP_NAMESPACE}::decode_attention_tpu"
        op = getattr(custom_ops, "OPDEFS", {}).get(qualname)
        if op is None:
            with warnings.catch_warnings():  # jax_op warns once that it is experimental; this kernel knows
                warnings.filterwarnings("ignore", message=".*jax_op is experimental")
                op = jax_op(qualname, jk.decode_attention_device)
        _TPU_OP.append(op)
    return _TPU_OP[0]


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[2] != 1:
        raise ValueError(
            "decode_attention expects query (batch, heads, 1, head_dim) and key, value (batch, kv_heads, slots, "
            f"head_dim); got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    batch, heads, _, dim = query.shape
    if key.shape[0] != batch or value.shape[:3] != key.shape[:3] or key.shape[3] != dim:
        raise ValueError(
            f"decode_attention: key {tuple(key.shape)} and value {tuple(value.shape)} do not fit query "
            f"{tuple(query.shape)} (same batch, key's head_dim the query's, value's slots the key's)"
        )
    if key.shape[1] == 0 or heads % key.shape[1]:
        raise ValueError(f"decode_attention: {heads} query heads are not a multiple of {key.shape[1]} KV heads")
    if mask.dtype != torch.bool or tuple(mask.shape) != (batch, key.shape[2]):
        raise ValueError(
            f"decode_attention: the mask must be bool (batch, slots) = ({batch}, {key.shape[2]}); got {mask.dtype} "
            f"{tuple(mask.shape)}"
        )


def _impl(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float, implementation: str
) -> torch.Tensor:
    _check(query, key, value, mask)
    placement = _placement(query)
    impl = _resolve(implementation, placement)
    if impl == "reference":
        return reference(query, key, value, mask, scale)
    if placement == "torch_tpu":
        return torch_tpu_op()(query, key, value, mask.to(torch.int32), scale, impl)
    if placement == "cpu":
        return _host_jax(impl, query, key, value, mask, scale)
    views = [_host_view(t) for t in (query, key, value, mask)]
    result = _host_jax(impl, *views, scale)
    out = torch.empty(result.shape, dtype=result.dtype, device=query.device)
    _host_view(out).copy_(result)
    return out


def _fake(query, key, value, mask, scale, implementation):
    _check(query, key, value, mask)
    return query.new_empty((query.shape[0], query.shape[1], 1, value.shape[-1]))


def _register():
    from torch._library import custom_ops

    qualname = f"{OP_NAMESPACE}::decode_attention"
    existing = getattr(custom_ops, "OPDEFS", {}).get(qualname)
    if existing is not None:  # this very build was imported before (e.g. from another path)
        return existing
    schema = "(Tensor query, Tensor key, Tensor value, Tensor mask, float scale, str implementation) -> Tensor"
    op = torch.library.custom_op(qualname, _impl, mutates_args=(), schema=schema)
    op.register_fake(_fake)
    return op


decode_attention_op = _register()


def _as_mask(lengths_or_mask: torch.Tensor, batch: int, slots: int) -> torch.Tensor:
    """``(batch, slots)`` bool from a bool mask ``(batch or 1, slots)`` or integer lengths ``(batch,)`` (the first
    ``length`` slots of each row valid)."""
    t = lengths_or_mask
    if t.dim() == 1 and not t.is_floating_point() and t.dtype != torch.bool:
        if t.shape[0] != batch:
            raise ValueError(f"decode_attention: {t.shape[0]} lengths for a batch of {batch}")
        return torch.arange(slots, device=t.device)[None, :] < t[:, None]
    if t.dim() == 2 and t.dtype == torch.bool and t.shape[1] == slots and t.shape[0] in (1, batch):
        return t.expand(batch, slots)
    raise ValueError(
        f"decode_attention: lengths_or_mask must be integer lengths ({batch},) or a bool mask ({batch}, {slots}) "
        f"(True where a slot is attended); got {t.dtype} {tuple(t.shape)}"
    )


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths_or_mask: torch.Tensor,
    scale: float | None = None,
    *,
    implementation: str = "auto",
) -> torch.Tensor:
    """Attention of a one-token query over a static cache whose rows are filled to different lengths.

    Args:
        query: ``(batch, heads, 1, head_dim)``.
        key, value: ``(batch, kv_heads, slots, head_dim)`` (``value``'s last dim may differ); ``heads`` a multiple of
            ``kv_heads`` (grouped-query attention: query head ``i`` reads KV head ``i // (heads // kv_heads)``).
        lengths_or_mask: integer ``(batch,)``, each row's filled length (slots ``[0, length)`` attended), or a bool
            ``(batch, slots)`` mask, True where a slot is attended (a left-padded row: True after its padding).
        scale: the scores' factor, ``head_dim ** -0.5`` when None.
        implementation: ``"auto"`` (the Pallas kernel on TorchTPU's device, :func:`reference` elsewhere),
            ``"reference"``, ``"pallas"``, ``"pallas_interpret"`` or ``"xla"`` (in JAX on the host).

    Returns:
        ``(batch, heads, 1, value's head_dim)`` in the query's dtype, as ``scaled_dot_product_attention`` returns it;
        zeros for a row with no attended slot.

    Example:
        >>> q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
        >>> decode_attention(q, k, v, torch.tensor([16, 5])).shape
        torch.Size([2, 4, 1, 8])
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"decode_attention: unknown implementation {implementation!r}; choose one of {', '.join(IMPLEMENTATIONS)}"
        )
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(
            "decode_attention expects query (batch, heads, 1, head_dim) and key (batch, kv_heads, slots, head_dim); "
            f"got {tuple(query.shape)}, {tuple(key.shape)}"
        )
    mask = _as_mask(lengths_or_mask, query.shape[0], key.shape[2])
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    return decode_attention_op(query, key, value, mask, scale, implementation)
