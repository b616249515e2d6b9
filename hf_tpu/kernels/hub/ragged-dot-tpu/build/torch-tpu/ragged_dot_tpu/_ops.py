"""The torch side: ``ragged_dot`` as a ``torch.library.custom_op`` and the torch <-> JAX bridge behind it.

Where the tensors live decides how they reach JAX:

- ``cpu``: zero-copy through DLPack into JAX's CPU backend; the XLA path runs there.
- ``tpu`` under TorchTPU (``torch_tpu``): the JAX function is handed to TorchTPU's own JAX bridge
  (``torch.tpu.pallas.custom_jax_kernel``), which compiles it into the device program and runs it on the
  tensors where they are; the Pallas kernel runs there.
- ``tpu`` on hf_tpu's simulated device (the only other way to have a ``tpu`` tensor without ``torch_tpu``):
  see :func:`_host_view`.

The op has a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` traces it as one node, with an
output shape that depends on the input shapes only.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

__all__ = ["IMPLEMENTATIONS", "OP_NAMESPACE", "ragged_dot", "ragged_dot_op"]

IMPLEMENTATIONS = ("auto", "pallas", "pallas_interpret", "xla", "xla_tiled")


def _namespace() -> str:
    # One namespace per kernel build: loading the same build twice (say from the Hub cache and from a local
    # checkout) reuses the registered op, and two different builds never collide.
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return f"_ragged_dot_tpu_{digest.hexdigest()[:10]}"


OP_NAMESPACE = _namespace()


def _jax():
    try:
        import jax
    except ImportError as exc:  # pragma: no cover - exercised only without jax
        raise ImportError(
            "the ragged-dot-tpu kernel runs its grouped matmul in JAX, but jax is not installed; "
            "install it with `pip install jax` (on a TPU VM: `pip install 'jax[tpu]'`)."
        ) from exc
    return jax


def _host_view(t: torch.Tensor) -> torch.Tensor | None:
    """The CPU tensor sharing a *simulated* ``tpu`` tensor's buffer, or None for any other tensor.

    Hook for hf_tpu's simulated device (a ``tpu`` device over CPU memory used to test TPU code on hosts
    without one). The kernel does not import hf_tpu: it only asks the simulator if the simulator is already
    loaded (``hf_tpu.sim.is_sim_tensor`` / ``hf_tpu.sim.host_view``), and then reads and writes the simulated
    buffers in place, like a device kernel would (no host transfer is recorded).
    """
    sim = sys.modules.get("hf_tpu.sim")
    is_sim_tensor = getattr(sim, "is_sim_tensor", None)
    if is_sim_tensor is None or not is_sim_tensor(t):
        return None
    return sim.host_view(t)


def _cpu_impl(impl: str) -> str:
    return "xla_tiled" if impl == "auto" else impl


def _run_jax(impl: str, lhs, rhs, group_sizes, rhs_transposed: bool):
    from . import _jax_kernels as jk

    if impl == "pallas":
        return jk.ragged_dot_pallas(lhs, rhs, group_sizes, rhs_transposed=rhs_transposed)
    if impl == "pallas_interpret":
        return jk.ragged_dot_pallas(lhs, rhs, group_sizes, rhs_transposed=rhs_transposed, interpret=True)
    if impl == "xla":
        return jk.ragged_dot_xla(lhs, rhs, group_sizes, rhs_transposed=rhs_transposed)
    if impl == "xla_tiled":
        return jk.ragged_dot_xla_tiled(lhs, rhs, group_sizes, rhs_transposed=rhs_transposed)
    raise ValueError(f"ragged_dot: unknown implementation {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}")


def _ragged_dot_host(
    lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, rhs_transposed: bool, impl: str
) -> torch.Tensor:
    """CPU tensors in, CPU tensor out, through DLPack (zero-copy both ways when the layout allows)."""
    jax = _jax()
    with jax.default_device(jax.devices("cpu")[0]):
        out = _run_jax(
            _cpu_impl(impl),
            jax.dlpack.from_dlpack(lhs.detach().contiguous()),
            jax.dlpack.from_dlpack(rhs.detach().contiguous()),
            jax.dlpack.from_dlpack(group_sizes.detach().to(torch.int32).contiguous()),
            rhs_transposed,
        )
    return torch.from_dlpack(out)


_TPU_CALLABLES: dict[tuple[str, bool], object] = {}


def _ragged_dot_torch_tpu(lhs, rhs, group_sizes, rhs_transposed: bool, impl: str) -> torch.Tensor:
    """Real TPU: TorchTPU compiles the JAX function (Pallas kernel inside) and runs it on the device tensors."""
    impl = "pallas" if impl == "auto" else impl
    key = (impl, rhs_transposed)
    fn = _TPU_CALLABLES.get(key)
    if fn is None:
        pallas = getattr(getattr(torch, "tpu", None), "pallas", None)
        if pallas is None or not hasattr(pallas, "custom_jax_kernel"):
            raise RuntimeError(
                "ragged_dot got tensors on a 'tpu' device, but torch.tpu.pallas.custom_jax_kernel (TorchTPU's JAX "
                "bridge) is missing; install torch-tpu>=0.2 with jax, or move the tensors to the CPU."
            )
        _jax()

        def kernel(lhs, rhs, group_sizes):
            return _run_jax(impl, lhs, rhs, group_sizes, rhs_transposed)

        fn = pallas.custom_jax_kernel(kernel, name=f"ragged_dot_tpu_{impl}", warn_deprecated=False)
        _TPU_CALLABLES[key] = fn
    return fn(lhs, rhs, group_sizes.to(torch.int32))


def _check(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, rhs_transposed: bool) -> int:
    if lhs.dim() != 2 or rhs.dim() != 3 or group_sizes.dim() != 1:
        raise ValueError(
            "ragged_dot expects lhs (M, K), rhs (G, K, N) or (G, N, K) with rhs_transposed, group_sizes (G,); got "
            f"{tuple(lhs.shape)}, {tuple(rhs.shape)}, {tuple(group_sizes.shape)}"
        )
    k = rhs.shape[2] if rhs_transposed else rhs.shape[1]
    if lhs.shape[1] != k or group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(
            f"ragged_dot: lhs {tuple(lhs.shape)} does not fit rhs {tuple(rhs.shape)} "
            f"(rhs_transposed={rhs_transposed}) with {group_sizes.shape[0]} group sizes"
        )
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"ragged_dot: lhs is {lhs.dtype} but rhs is {rhs.dtype}; cast one of them first")
    return rhs.shape[1] if rhs_transposed else rhs.shape[2]


def _impl(
    lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, rhs_transposed: bool, implementation: str
) -> torch.Tensor:
    _check(lhs, rhs, group_sizes, rhs_transposed)
    if lhs.device.type == "cpu":
        return _ragged_dot_host(lhs, rhs, group_sizes, rhs_transposed, implementation)
    host = [_host_view(t) for t in (lhs, rhs, group_sizes)]
    if all(h is not None for h in host):
        result = _ragged_dot_host(*host, rhs_transposed, implementation)
        out = torch.empty(result.shape, dtype=result.dtype, device=lhs.device)
        _host_view(out).copy_(result)
        return out
    if lhs.device.type == "tpu":
        return _ragged_dot_torch_tpu(lhs, rhs, group_sizes, rhs_transposed, implementation)
    raise NotImplementedError(
        f"ragged_dot runs on 'tpu' (TorchTPU or hf_tpu's simulator) and 'cpu' tensors; got {lhs.device}. "
        "Move the tensors to one of those devices."
    )


def _fake(lhs, rhs, group_sizes, rhs_transposed, implementation):
    n = _check(lhs, rhs, group_sizes, rhs_transposed)
    return lhs.new_empty((lhs.shape[0], n))


def _register():
    from torch._library import custom_ops

    qualname = f"{OP_NAMESPACE}::ragged_dot"
    existing = getattr(custom_ops, "OPDEFS", {}).get(qualname)
    if existing is not None:  # this very build was imported before (e.g. from another path)
        return existing
    op = torch.library.custom_op(
        qualname,
        _impl,
        mutates_args=(),
        schema="(Tensor lhs, Tensor rhs, Tensor group_sizes, bool rhs_transposed, str implementation) -> Tensor",
    )
    op.register_fake(_fake)
    return op


ragged_dot_op = _register()


def ragged_dot(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    *,
    rhs_transposed: bool = False,
    implementation: str = "auto",
) -> torch.Tensor:
    """Grouped matmul: rows of ``lhs`` sorted by group, ``group_sizes[g]`` rows times ``rhs[g]``.

    ``rhs`` is (G, K, N), or (G, N, K) with ``rhs_transposed=True`` (transformers' expert weight layout).
    Rows past ``group_sizes.sum()`` are zeros. ``implementation``: ``"auto"`` (Pallas on TPU, the tiled XLA
    path on CPU), ``"pallas"``, ``"pallas_interpret"`` (the Pallas kernel body run by the interpreter),
    ``"xla"`` (``jax.lax.ragged_dot``), ``"xla_tiled"``.

    Example:
        >>> x = torch.randn(5, 8); w = torch.randn(2, 8, 4); sizes = torch.tensor([3, 2])
        >>> torch.allclose(ragged_dot(x, w, sizes)[:3], x[:3] @ w[0], atol=1e-5)
        True
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"ragged_dot: unknown implementation {implementation!r}; choose one of {', '.join(IMPLEMENTATIONS)}"
        )
    return ragged_dot_op(lhs, rhs, group_sizes, rhs_transposed, implementation)
