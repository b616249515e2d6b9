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

__all__ = ["IMPLEMENTATIONS", "OP_NAMESPACE", "gated_mlp_op", "ragged_dot", "ragged_dot_op"]

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


def _placement(t: torch.Tensor) -> str:
    """``"cpu"``, ``"sim"`` (hf_tpu's simulated tpu) or ``"torch_tpu"``: decides how the tensors reach JAX."""
    if t.device.type == "cpu":
        return "cpu"
    if _host_view(t) is not None:
        return "sim"
    if t.device.type == "tpu":
        return "torch_tpu"
    raise NotImplementedError(
        f"ragged_dot_tpu runs on 'tpu' (TorchTPU or hf_tpu's simulator) and 'cpu' tensors; got {t.device}. "
        "Move the tensors to one of those devices."
    )


def _resolve(impl: str, placement: str) -> str:
    """The implementation to run: Pallas where a TPU compiles it, the XLA loop in host memory."""
    if placement == "torch_tpu":
        return "pallas" if impl == "auto" else impl
    if impl == "pallas":
        raise ValueError(
            "ragged_dot: implementation='pallas' compiles a TPU (Mosaic) kernel, but these tensors live in host memory "
            "(CPU or the simulated device); use 'pallas_interpret' to run the same kernel body there, or 'auto'."
        )
    return "xla_tiled" if impl == "auto" else impl


def _host_call(jax_fn, *tensors: torch.Tensor) -> torch.Tensor:
    """Run ``jax_fn`` on CPU tensors through DLPack (zero-copy both ways when the layout allows).

    The arrays are committed to JAX's CPU device, so the computation runs there whatever JAX's default backend.
    (JAX starts every backend it finds on first use: in a TorchTPU process, set ``JAX_PLATFORMS=cpu`` so that it
    leaves the chip to TorchTPU.)
    """
    jax = _jax()
    arrays = [jax.dlpack.from_dlpack(t.detach().contiguous()) for t in tensors]
    return torch.from_dlpack(jax_fn(*arrays))


_TPU_CALLABLES: dict[str, object] = {}


def _torch_tpu_callable(name: str, jax_fn):
    """TorchTPU's JAX bridge around ``jax_fn``, built once per name: TorchTPU exports the function (Pallas kernels
    inside), compiles it into the device program and runs it on the device tensors where they are."""
    fn = _TPU_CALLABLES.get(name)
    if fn is None:
        pallas = getattr(getattr(torch, "tpu", None), "pallas", None)
        if pallas is None or not hasattr(pallas, "custom_jax_kernel"):
            raise RuntimeError(
                "ragged_dot_tpu got tensors on a 'tpu' device, but torch.tpu.pallas.custom_jax_kernel (TorchTPU's "
                "JAX bridge) is missing; install torch-tpu>=0.2 with jax, or move the tensors to the CPU."
            )
        _jax()
        fn = pallas.custom_jax_kernel(jax_fn, name=name, warn_deprecated=False)
        _TPU_CALLABLES[name] = fn
    return fn


def _run(name: str, jax_fn, *tensors: torch.Tensor) -> torch.Tensor:
    """Run ``jax_fn`` (JAX arrays in, one array out) where the tensors are."""
    placement = _placement(tensors[0])
    if placement == "cpu":
        return _host_call(jax_fn, *tensors)
    if placement == "sim":
        result = _host_call(jax_fn, *(_host_view(t) for t in tensors))
        out = torch.empty(result.shape, dtype=result.dtype, device=tensors[0].device)
        _host_view(out).copy_(result)
        return out
    return _torch_tpu_callable(name, jax_fn)(*tensors)


_JAX_FNS: dict[str, object] = {}


def _jax_fn(kind: str, impl: str, rhs_transposed: bool):
    """One JAX function object per (kind, implementation, layout), so TorchTPU's bridge caches its compilation."""
    name = f"ragged_dot_tpu_{kind}_{impl}_{'nk' if rhs_transposed else 'kn'}"
    fn = _JAX_FNS.get(name)
    if fn is None:
        from . import _jax_kernels as jk

        if kind == "ragged_dot":

            def fn(lhs, rhs, group_sizes):
                return _run_jax(impl, lhs, rhs, group_sizes, rhs_transposed)
        else:

            def fn(x, gate_up, down, group_sizes):
                return jk.gated_mlp(x, gate_up, down, group_sizes, rhs_transposed=rhs_transposed, implementation=impl)

        _JAX_FNS[name] = fn
    return name, fn


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
    name, fn = _jax_fn("ragged_dot", _resolve(implementation, _placement(lhs)), rhs_transposed)
    return _run(name, fn, lhs, rhs, group_sizes.to(torch.int32))


def _gated_mlp_impl(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    group_sizes: torch.Tensor,
    rhs_transposed: bool,
    implementation: str,
) -> torch.Tensor:
    _check(x, gate_up, group_sizes, rhs_transposed)
    name, fn = _jax_fn("gated_mlp", _resolve(implementation, _placement(x)), rhs_transposed)
    return _run(name, fn, x, gate_up, down, group_sizes.to(torch.int32))


def _fake(lhs, rhs, group_sizes, rhs_transposed, implementation):
    n = _check(lhs, rhs, group_sizes, rhs_transposed)
    return lhs.new_empty((lhs.shape[0], n))


def _gated_mlp_fake(x, gate_up, down, group_sizes, rhs_transposed, implementation):
    _check(x, gate_up, group_sizes, rhs_transposed)
    return x.new_empty((x.shape[0], down.shape[1] if rhs_transposed else down.shape[2]))


def _register(name: str, impl, fake, schema: str):
    from torch._library import custom_ops

    qualname = f"{OP_NAMESPACE}::{name}"
    existing = getattr(custom_ops, "OPDEFS", {}).get(qualname)
    if existing is not None:  # this very build was imported before (e.g. from another path)
        return existing
    op = torch.library.custom_op(qualname, impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    return op


ragged_dot_op = _register(
    "ragged_dot",
    _impl,
    _fake,
    "(Tensor lhs, Tensor rhs, Tensor group_sizes, bool rhs_transposed, str implementation) -> Tensor",
)
gated_mlp_op = _register(
    "gated_mlp",
    _gated_mlp_impl,
    _gated_mlp_fake,
    "(Tensor x, Tensor gate_up, Tensor down, Tensor group_sizes, bool rhs_transposed, str implementation) -> Tensor",
)


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
