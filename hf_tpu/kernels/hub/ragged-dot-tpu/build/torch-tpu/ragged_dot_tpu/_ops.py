"""The torch side: ``ragged_dot`` as a ``torch.library.custom_op`` and the torch <-> JAX bridge behind it.

Where the tensors live decides how they reach JAX:

- ``cpu``: zero-copy through DLPack into JAX's CPU backend; the XLA path runs there.
- ``tpu`` under TorchTPU (``torch_tpu``): the JAX function goes through TorchTPU's public JAX bridge,
  ``torch.tpu.pallas.jax_op`` (torch-tpu 0.2.0), which registers it as a ``torch.library.custom_op`` of its own;
  calling that op exports the function for the TPU platform, and TorchTPU compiles and runs it on the tensors
  where they are (see :func:`torch_tpu_ops`); the Pallas kernel runs there.
- ``tpu`` on hf_tpu's simulated device (the only other way to have a ``tpu`` tensor without ``torch_tpu``):
  see :func:`_host_view`.

The op has a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` traces it as one node, with an
output shape that depends on the input shapes only.
"""

from __future__ import annotations

import hashlib
import sys
import warnings
import weakref
from pathlib import Path

import torch

__all__ = ["IMPLEMENTATIONS", "OP_NAMESPACE", "experts_op", "ragged_dot", "ragged_dot_op", "torch_tpu_ops"]

IMPLEMENTATIONS = (
    "auto", "pallas", "pallas_interpret", "pallas_decode", "pallas_decode_interpret", "megablox", "megablox_interpret",
    "dense", "xla", "xla_tiled",
)  # fmt: skip
#: Implementations that compile a Mosaic (TPU) kernel: not for tensors in host memory.
TPU_ONLY = ("pallas", "pallas_decode", "megablox")


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
            "the ragged-dot-tpu kernel runs its grouped matmul in JAX, but jax is not installed; install it with "
            "`pip install jax` (also on a TPU VM: not 'jax[tpu]', whose libtpu pin conflicts with torch-tpu's)."
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
    if impl in TPU_ONLY:
        raise ValueError(
            f"ragged_dot: implementation={impl!r} compiles a TPU (Mosaic) kernel, but these tensors live in host "
            f"memory (CPU or the simulated device); use '{impl}_interpret' to run the same kernel body there, or "
            "'auto'."
        )
    return "xla_tiled" if impl == "auto" else impl


def _public_to_jax(t: torch.Tensor):
    return _jax().dlpack.from_dlpack(t)


def _fast_cpu_importer():
    """A CPU tensor -> JAX array import without ``jax.dlpack.from_dlpack``'s Python layers (~30 us a tensor, as
    much as the arithmetic of a one-token expert layer), or None where this jaxlib does not offer it.

    It calls jaxlib's DLPack import directly; it is used only after a probe shows that it returns a JAX array
    sharing the tensor's memory with the right contents, and only for dtypes that JAX keeps as they are.
    """
    jax = _jax()
    try:
        from jax._src.lib import _jax as jaxlib_ext
        from jax._src.lib import jaxlib_extension_version

        device = jax.devices("cpu")[0]
        to_buffer = jaxlib_ext.dlpack_managed_tensor_to_buffer
        cpu = 1  # DLPack's kDLCPU

        if jaxlib_extension_version >= 467:

            def importer(t):
                return to_buffer(t.__dlpack__(), device, None, None, cpu)
        else:

            def importer(t):
                return to_buffer(t.__dlpack__(), device, None, None)

        probe = torch.arange(16, dtype=torch.float32).reshape(4, 4)
        array = importer(probe)
        if not (
            isinstance(array, jax.Array)
            and array.unsafe_buffer_pointer() == probe.data_ptr()
            and array.shape == (4, 4)
            and bool((jax.numpy.asarray(array) == jax.numpy.arange(16.0).reshape(4, 4)).all())
        ):
            return None
        return importer
    except Exception:  # noqa: BLE001 - a jaxlib without this entry point, or another signature: the public API then
        return None


_FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32)
_importer = None


def _to_jax(t: torch.Tensor):
    """A contiguous CPU tensor as a JAX CPU array sharing its memory."""
    global _importer
    if _importer is None:
        _importer = _fast_cpu_importer() or _public_to_jax
    if t.dtype in _FAST_DTYPES:
        return _importer(t)
    return _public_to_jax(t)


# id(weight tensor) -> (its memory signature, its matrices as JAX arrays, a weak reference to the tensor)
_MATRICES: dict[int, tuple] = {}


def _matrices(t: torch.Tensor, owner: torch.Tensor):
    """The G matrices of a (G, ., .) CPU weight ``t`` as JAX arrays sharing its memory, or None.

    XLA on the CPU copies a weight out of a (G, ., .) array each time a loop indexes it; handed the matrices as
    separate arrays, it reads them where they lie. Importing G arrays costs more than the arithmetic of a small
    batch, so they are kept per weight tensor (``owner``: the tensor the caller holds, the simulated one on
    hf_tpu's simulator), as long as the tensor lives and its memory stays where it was. The arrays are views,
    not copies (checked here; a weight JAX would copy is not kept), so in-place updates of the weight show
    through; a weight moved, cast or replaced gets new arrays on its next call.
    """
    signature = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
    key = id(owner)
    entry = _MATRICES.get(key)
    if entry is not None and entry[0] == signature and entry[2]() is owner:
        return entry[1]
    if t.dim() != 3 or not t.is_contiguous() or t.dtype not in _FAST_DTYPES or t.shape[0] == 0:
        return None
    weight = t.detach()
    matrices = tuple(_to_jax(weight[g]) for g in range(weight.shape[0]))
    if any(m.unsafe_buffer_pointer() != weight[g].data_ptr() for g, m in enumerate(matrices)):
        matrices = None  # JAX copied (say, a misaligned matrix): a kept copy would go stale; remembered as such

    def forget(ref, key=key):
        if _MATRICES.get(key, (None, None, None))[2] is ref:
            del _MATRICES[key]

    _MATRICES[key] = (signature, matrices, weakref.ref(owner, forget))
    return matrices


def _host_call(jax_fn, tensors, owners, split=()) -> torch.Tensor:
    """Run ``jax_fn`` on CPU tensors through DLPack (zero-copy both ways when the layout allows).

    ``split``: positions of (G, ., .) weights to hand over as tuples of matrices where possible (see
    :func:`_matrices`; ``owners`` are the tensors the caller passed). The arrays are committed to JAX's CPU
    device, so the computation runs there whatever JAX's default backend. (JAX starts every backend it finds on
    first use: in a TorchTPU process, set ``JAX_PLATFORMS=cpu`` so that it leaves the chip to TorchTPU.)
    """
    arrays = []
    for i, (t, owner) in enumerate(zip(tensors, owners, strict=True)):
        matrices = _matrices(t, owner) if i in split else None
        arrays.append(matrices if matrices is not None else _to_jax(t.detach().contiguous()))
    return torch.from_dlpack(jax_fn(*arrays))


# The kernel's custom ops registered through TorchTPU's jax_op: kind ("ragged_dot", "moe_experts") -> op
_TPU_OPS: dict[str, object] = {}


def _jax_op():
    """``torch.tpu.pallas.jax_op``, TorchTPU's public JAX bridge, or a RuntimeError naming what is missing."""
    tpu = getattr(torch, "tpu", None)
    if tpu is None:
        raise RuntimeError(
            "ragged_dot_tpu got tensors on a 'tpu' device, but torch.tpu is missing: TorchTPU (torch_tpu) is not "
            "loaded in this process; install torch-tpu>=0.2.0 (pip install torch-tpu jax), or move the tensors to "
            "the CPU."
        )
    try:
        pallas = tpu.pallas
        return pallas.jax_op
    except ImportError as exc:  # torch_tpu's pallas module imports jax (and absl, frozendict) on first access
        raise RuntimeError(
            f"ragged_dot_tpu: torch.tpu.pallas.jax_op (TorchTPU's JAX bridge) failed to import ({exc}); "
            "install jax next to torch-tpu: pip install jax"
        ) from exc
    except AttributeError as exc:
        raise RuntimeError(
            f"ragged_dot_tpu needs torch.tpu.pallas.jax_op (TorchTPU's public JAX bridge, torch-tpu 0.2.0), but this "
            f"torch_tpu does not have it ({exc}); install torch-tpu 0.2.x."
        ) from exc


def torch_tpu_ops() -> dict[str, object]:
    """The kernel's JAX functions as TorchTPU ops: ``{"ragged_dot": op, "moe_experts": op}``.

    Registered once per process with ``torch.tpu.pallas.jax_op("<OP_NAMESPACE>::<kind>_tpu", fn)``, TorchTPU's
    public JAX bridge (torch-tpu 0.2.0): each is a ``torch.library.custom_op`` whose schema TorchTPU derives from
    the JAX function's annotations (``(Tensor lhs, Tensor rhs, Tensor group_sizes, bool rhs_transposed,
    str implementation) -> Tensor``), whose fake implementation exports the function for the TPU platform to learn
    the output shapes, and whose device implementation exports it, hands the program to TorchTPU and runs it on the
    tensors where they are. Loading the same build twice reuses the ops (same namespace).
    """
    if len(_TPU_OPS) < 2:
        jax_op = _jax_op()
        _jax()
        from torch._library import custom_ops

        from . import _jax_kernels as jk

        for kind, fn in (("ragged_dot", jk.ragged_dot_device), ("moe_experts", jk.moe_experts_device)):
            qualname = f"{OP_NAMESPACE}::{kind}_tpu"
            op = getattr(custom_ops, "OPDEFS", {}).get(qualname)
            if op is None:
                with warnings.catch_warnings():  # jax_op warns once that it is experimental; this kernel knows
                    warnings.filterwarnings("ignore", message=".*jax_op is experimental")
                    op = jax_op(qualname, fn)
            _TPU_OPS[kind] = op
    return dict(_TPU_OPS)


def _run(kind: str, impl: str, rhs_transposed: bool, *tensors: torch.Tensor, split: tuple[int, ...] = ()):
    """Run the kernel's JAX function of ``kind`` where the tensors are. ``split``: see :func:`_host_call`."""
    placement = _placement(tensors[0])
    if placement == "torch_tpu":
        return torch_tpu_ops()[kind](*tensors, rhs_transposed, impl)
    jax_fn = _jax_fn(kind, impl, rhs_transposed)
    if placement == "cpu":
        return _host_call(jax_fn, tensors, tensors, split)
    result = _host_call(jax_fn, [_host_view(t) for t in tensors], tensors, split)
    out = torch.empty(result.shape, dtype=result.dtype, device=tensors[0].device)
    _host_view(out).copy_(result)
    return out


_JAX_FNS: dict[tuple[str, str, bool], object] = {}


def _jax_fn(kind: str, impl: str, rhs_transposed: bool):
    """One JAX function object per (kind, implementation, layout) for the host paths."""
    key = (kind, impl, rhs_transposed)
    fn = _JAX_FNS.get(key)
    if fn is None:
        from . import _jax_kernels as jk

        if kind == "ragged_dot":

            def fn(lhs, rhs, group_sizes):
                return _run_jax(impl, lhs, rhs, group_sizes, rhs_transposed)
        else:

            def fn(hidden, top_k_index, top_k_weights, gate_up, down):
                return jk.moe_experts(
                    hidden,
                    top_k_index,
                    top_k_weights,
                    gate_up,
                    down,
                    rhs_transposed=rhs_transposed,
                    implementation=impl,
                )

        _JAX_FNS[key] = fn
    return fn


def _run_jax(impl: str, lhs, rhs, group_sizes, rhs_transposed: bool):
    from . import _jax_kernels as jk

    if impl not in IMPLEMENTATIONS or impl == "auto":
        raise ValueError(f"ragged_dot: unknown implementation {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
    return jk._dot_for(impl)(lhs, rhs, group_sizes, rhs_transposed=rhs_transposed)


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
    impl = _resolve(implementation, _placement(lhs))
    split = (1,) if impl == "xla_tiled" else ()
    return _run("ragged_dot", impl, rhs_transposed, lhs, rhs, group_sizes.to(torch.int32), split=split)


def _check_experts(hidden, top_k_index, top_k_weights, gate_up, down, rhs_transposed) -> None:
    if hidden.dim() != 2 or top_k_index.dim() != 2 or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            "moe_experts expects hidden (T, H), top_k_index and top_k_weights (T, k); got "
            f"{tuple(hidden.shape)}, {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}"
        )
    if top_k_index.shape[0] != hidden.shape[0]:
        raise ValueError(f"moe_experts: {hidden.shape[0]} tokens but routing for {top_k_index.shape[0]}")
    if top_k_index.dtype != torch.int32:
        raise ValueError(f"moe_experts: top_k_index must be int32 (got {top_k_index.dtype}); call .int() first")
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        raise ValueError(
            f"moe_experts: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} must be (E, ., .) weights"
        )
    h = hidden.shape[1]
    inter2, k_in = (gate_up.shape[1], gate_up.shape[2]) if rhs_transposed else (gate_up.shape[2], gate_up.shape[1])
    d_out, d_in = (down.shape[1], down.shape[2]) if rhs_transposed else (down.shape[2], down.shape[1])
    if k_in != h or d_out != h or inter2 != 2 * d_in:
        raise ValueError(
            f"moe_experts: hidden size {h} does not fit gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} "
            f"(rhs_transposed={rhs_transposed}); gate_up must hold the gate and up halves (2 x intermediate)"
        )
    if gate_up.dtype != down.dtype:
        raise ValueError(f"moe_experts: gate_up is {gate_up.dtype} but down is {down.dtype}; cast one of them first")


def _experts_impl(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    rhs_transposed: bool,
    implementation: str,
) -> torch.Tensor:
    _check_experts(hidden, top_k_index, top_k_weights, gate_up, down, rhs_transposed)
    impl = _resolve(implementation, _placement(hidden))
    split = (3, 4) if impl == "xla_tiled" else ()
    return _run("moe_experts", impl, rhs_transposed, hidden, top_k_index, top_k_weights, gate_up, down, split=split)


def _fake(lhs, rhs, group_sizes, rhs_transposed, implementation):
    n = _check(lhs, rhs, group_sizes, rhs_transposed)
    return lhs.new_empty((lhs.shape[0], n))


def _experts_fake(hidden, top_k_index, top_k_weights, gate_up, down, rhs_transposed, implementation):
    _check_experts(hidden, top_k_index, top_k_weights, gate_up, down, rhs_transposed)
    return hidden.new_empty(hidden.shape)


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
experts_op = _register(
    "moe_experts",
    _experts_impl,
    _experts_fake,
    "(Tensor hidden, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up, Tensor down, bool rhs_transposed, "
    "str implementation) -> Tensor",
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
