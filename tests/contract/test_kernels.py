"""The ragged-dot kernel and hf_tpu's kernels integration against torch-tpu 0.2.0's own Python (no chips).

- Every ``torch.tpu.*`` name the kernel and hf_tpu.kernels use exists in the wheel's public API, and the names the
  kernel used to rely on (``torch.tpu.pallas.custom_jax_kernel``, a ``torch.backends.tpu`` set by torch_tpu) do not.
- The kernel's ops register through the real ``torch.tpu.pallas.jax_op``: schemas, and fake implementations that
  export the kernel for the TPU platform (Mosaic lowering) and give the output shapes, for real models' shapes,
  including N and K that are not multiples of 128, each with tiles inside the VMEM budget.
- With ``hf_tpu.enable()`` on a host reported as having chips (only runtime's answer is stood in), plain
  ``kernels.get_local_kernel`` on the shipped repository picks the ``torch-tpu`` variant where kernels reads
  ``torch.backends.tpu`` (0.17); kernels 0.18+ reads the accelerator, which torch-tpu sets only with chips (a warning
  says so); hf_tpu's loader picks it either way; ``hf_tpu.disable()`` puts everything back.

What only a chip can show (the device implementation of a jax_op op: TorchTPU registering and running the
exported program, and Mosaic compiling it in libtpu) is listed in docs/kernels.md.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

# JAX would otherwise probe libtpu (installed with torch-tpu) for a TPU backend on first use; the exports below
# need none, and on a TPU VM TorchTPU owns the chip. Set before jax is imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # the tier's environment has it ('.[kernels]', and '.[tpu]' brings it): a missing jax is a failure
import pytest
import torch

import hf_tpu
from hf_tpu import runtime
from hf_tpu.kernels import RAGGED_DOT_REPO, load_ragged_dot_kernel

PACKAGE = RAGGED_DOT_REPO / "build" / "torch-tpu" / "ragged_dot_tpu"
SCHEMAS = {
    "ragged_dot": "(Tensor lhs, Tensor rhs, Tensor group_sizes, bool rhs_transposed, str implementation) -> Tensor",
    "moe_experts": "(Tensor hidden, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up, Tensor down, "
    "bool rhs_transposed, str implementation) -> Tensor",
}


@pytest.fixture(scope="module")
def kernel():
    return load_ragged_dot_kernel()


@pytest.fixture(scope="module")
def ops(kernel):
    return importlib.import_module(f"{kernel.__name__}._ops")


@pytest.fixture(scope="module")
def jk(kernel):
    return importlib.import_module(f"{kernel.__name__}._jax_kernels")


def _resolve(dotted: str):
    obj = torch
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def test_the_public_torch_tpu_pallas_is_jax_op_and_get_pallas_mesh():
    pallas = torch.tpu.pallas
    assert sorted(pallas.__all__) == ["get_pallas_mesh", "jax_op"]
    assert not hasattr(pallas, "custom_jax_kernel")  # deprecated, only in torch_tpu._internal.pallas.pallas
    assert callable(pallas.jax_op)
    assert not hasattr(torch.backends, "tpu")  # torch-tpu 0.2.0 does not set it, autoloaded or not


def test_every_torch_tpu_name_the_kernel_mentions_is_public():
    """Each ``torch.tpu.<...>`` written in the kernel package and in hf_tpu.kernels (code, messages, docstrings)
    resolves in the wheel's public API."""
    files = sorted(PACKAGE.glob("*.py")) + sorted(Path(hf_tpu.kernels.__file__).parent.glob("*.py"))
    names = set()
    for path in files:
        names.update(re.findall(r"\btorch\.tpu(?:\.[A-Za-z_]\w*)+", path.read_text()))
    assert "torch.tpu.pallas.jax_op" in names
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except AttributeError:
            missing.append(name)
    assert not missing, f"not in torch-tpu 0.2.0's public API: {missing}"


def test_kernel_ops_register_through_the_real_jax_op(ops):
    from torch_tpu._internal.pallas import pallas as tt_pallas

    registered = ops.torch_tpu_ops()
    assert set(registered) == set(SCHEMAS)
    for kind, op in registered.items():
        assert isinstance(op, tt_pallas._JaxCustomOpDef)  # what jax_op returns: a torch.library.custom_op
        packet = getattr(getattr(torch.ops, ops.OP_NAMESPACE), f"{kind}_tpu")
        assert str(packet.default._schema) == f"{ops.OP_NAMESPACE}::{kind}_tpu{SCHEMAS[kind]}"
    assert ops.torch_tpu_ops() == registered  # once per process


SHAPES = [  # (M, N, K, G, dtype): expert projections of real models
    (512, 1536, 2048, 128, torch.bfloat16),  # Qwen3-30B-A3B gate_up, 64 tokens x top-8
    (256, 4096, 14336, 8, torch.bfloat16),  # Mixtral-8x7B down: K split in tiles
    (256, 2880, 2880, 32, torch.bfloat16),  # gpt-oss down: N, K = 22.5 x 128
    (256, 5760, 2880, 32, torch.bfloat16),  # gpt-oss gate_up
    (37, 300, 200, 5, torch.float32),
]


@pytest.mark.parametrize(("m", "n", "k", "g", "dtype"), SHAPES, ids=lambda v: str(v).removeprefix("torch."))
def test_fake_implementation_exports_the_pallas_kernel_for_tpu(ops, jk, m, n, k, g, dtype):
    """The real jax_op fake implementation exports ``ragged_dot_device`` for the TPU platform (Mosaic lowering)
    and returns the output's shape and dtype; the tiles it lowered with fit the VMEM budget."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = ops.torch_tpu_ops()["ragged_dot"]
    with FakeTensorMode():
        lhs, rhs = torch.empty(m, k, dtype=dtype), torch.empty(g, n, k, dtype=dtype)
        out = op(lhs, rhs, torch.empty(g, dtype=torch.int32), True, "pallas")
    assert (tuple(out.shape), out.dtype) == ((m, n), dtype)
    tm, tn, tk = jk._tile_sizes(m, n, k, jk.jnp.dtype(str(dtype).removeprefix("torch.")))
    estimate = jk.vmem_bytes(tm, tn, tk, jk.jnp.dtype(str(dtype).removeprefix("torch.")), ragged_k=k % tk != 0)
    assert estimate <= jk.VMEM_BUDGET, (tm, tn, tk, estimate)
    # The same export TorchTPU's JaxCallable makes (jax.export for platforms=["tpu"]) holds the Mosaic kernel.
    exported = jax.export.export(
        jax.jit(jk.ragged_dot_device, static_argnums=(3, 4)),
        platforms=["tpu"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ALL")],
    )(
        jax.ShapeDtypeStruct((m, k), str(dtype).removeprefix("torch.")),
        jax.ShapeDtypeStruct((g, n, k), str(dtype).removeprefix("torch.")),
        jax.ShapeDtypeStruct((g,), "int32"),
        True,
        "pallas",
    )
    assert exported.mlir_module().count("tpu_custom_call") == 1


def test_fused_experts_op_fake_exports_for_tpu(ops):
    """The whole experts layer (two Pallas grouped matmuls) through the real jax_op, gpt-oss-sized, on meta."""
    op = ops.torch_tpu_ops()["moe_experts"]
    tokens, top_k, hidden, inter, experts = 64, 4, 2880, 2880, 32
    meta = {"device": "meta", "dtype": torch.bfloat16}
    out = op(
        torch.empty(tokens, hidden, **meta),
        torch.empty(tokens, top_k, device="meta", dtype=torch.int32),
        torch.empty(tokens, top_k, **meta),
        torch.empty(experts, 2 * inter, hidden, **meta),
        torch.empty(experts, hidden, inter, **meta),
        True,
        "pallas",
    )
    assert (tuple(out.shape), out.dtype, out.device.type) == ((tokens, hidden), torch.bfloat16, "meta")


def test_the_kernel_hands_tpu_tensors_to_the_jax_op_op(ops, kernel, monkeypatch):
    """The kernel's own entry point, as on a TPU VM: tensors TorchTPU owns (stood in by meta tensors, the one thing
    that needs a chip) go to the jax_op-registered op with ``implementation="auto"`` resolved to the Pallas
    kernel; the real fake implementation exports it and answers the shape."""
    calls = []
    registered = ops.torch_tpu_ops()

    def spy(kind):
        def call(*args):
            calls.append((kind, args[-2:]))
            return registered[kind](*args)

        return call

    monkeypatch.setattr(ops, "_placement", lambda t: "torch_tpu")
    monkeypatch.setattr(ops, "torch_tpu_ops", lambda: {kind: spy(kind) for kind in registered})
    lhs = torch.empty(64, 2880, device="meta", dtype=torch.bfloat16)
    rhs = torch.empty(8, 2880, 2880, device="meta", dtype=torch.bfloat16)
    out = ops._impl(lhs, rhs, torch.empty(8, device="meta", dtype=torch.int64), True, "auto")
    assert tuple(out.shape) == (64, 2880) and out.device.type == "meta"
    assert calls == [("ragged_dot", (True, "pallas"))]


@pytest.fixture
def host_with_chips(monkeypatch):
    """runtime's "this host has TPU chips" answer, stood in (the PCI scan finds none here); nothing else is."""
    monkeypatch.setattr(runtime, "is_real", lambda: True)
    hf_tpu.disable("kernels")
    yield
    hf_tpu.disable("kernels")


def test_enable_on_a_host_with_chips_selects_the_torch_tpu_variant(host_with_chips):
    """kernels 0.17 reads torch.backends.tpu, which torch-tpu 0.2.0 does not set: hf_tpu's placeholder makes plain
    get_local_kernel find torch-tpu. kernels 0.18+ reads torch.accelerator, which torch-tpu makes its tpu device only
    where its autoload finds chips (none here): enable() says that plain kernels still sees cpu and sets nothing.
    hf_tpu's own loader finds the variant either way, and disable() leaves torch.backends as it was."""
    import warnings

    from kernels import __version__ as kernels_version
    from kernels import get_local_kernel
    from packaging.version import Version

    from hf_tpu.kernels import kernels_backend, load_local_kernel

    reads_torch_backends_tpu = Version(Version(kernels_version).base_version) < Version("0.18")
    assert "torch_tpu" in sys.modules and not hasattr(torch.backends, "tpu")
    assert torch.accelerator.current_accelerator() is None  # without chips torch-tpu does not rename PrivateUse1
    backends_before = dict(vars(torch.backends))
    assert kernels_backend() == "cpu"  # what kernels sees under torch-tpu 0.2.0 alone
    with pytest.raises(FileNotFoundError, match="torch-tpu"):
        get_local_kernel(RAGGED_DOT_REPO)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_tpu.enable("kernels")
    said = [str(w.message) for w in caught if "on this TPU VM" in str(w.message)]
    if reads_torch_backends_tpu:
        assert kernels_backend() == "tpu" and not said
        module = get_local_kernel(RAGGED_DOT_REPO)
        assert module.__file__.endswith("build/torch-tpu/ragged_dot_tpu/__init__.py")
    else:
        assert kernels_backend() == "cpu" and not hasattr(torch.backends, "tpu")
        assert len(said) == 1 and "detects the backend 'cpu'" in said[0], said
    assert load_local_kernel(RAGGED_DOT_REPO).__file__.endswith("build/torch-tpu/ragged_dot_tpu/__init__.py")

    hf_tpu.disable("kernels")
    assert dict(vars(torch.backends)) == backends_before
    assert kernels_backend() == "cpu" and hf_tpu._patch.applied("kernels") == []
    assert torch.accelerator.current_accelerator() is None
    with pytest.raises(FileNotFoundError, match="torch-tpu"):
        get_local_kernel(RAGGED_DOT_REPO)


def test_the_kv_rows_writer_registers_through_the_real_jax_op_with_its_caches_donated():
    """hf_tpu's one-program KV rows writer (``HF_TPU_KV_ROWS_WRITER``, the default on torch_tpu's device) through
    torch-tpu's own ``jax_op``: a list-of-tensors schema, the caches (argument 0) donated, and the real fake
    implementation (JAX's export of the program) answers each cache's shape and dtype for a Llama-3.2-1B-shaped
    batch-64 cache."""
    from torch_tpu._internal.pallas import pallas as tt_pallas

    from hf_tpu.transformers._cache import writes

    op = writes._jax_rows_writer()
    assert op is writes._jax_rows_writer() and isinstance(op, tt_pallas._JaxCustomOpDef)
    assert "Tensor[] caches, Tensor[] rows, Tensor slot" in str(op._opoverload._schema)
    assert tuple(op._init_fn.donate_argnums) == (0,)  # the JaxCallable jax_op wraps: what it hands the runtime
    meta = {"device": "meta", "dtype": torch.bfloat16}
    caches = [torch.empty(64, 8, 640, 64, **meta) for _ in range(4)]
    rows = [torch.empty(64, 8, 1, 64, **meta) for _ in range(4)]
    out = op(caches, rows, torch.empty(1, device="meta", dtype=torch.int32))
    assert [(tuple(o.shape), o.dtype) for o in out] == [((64, 8, 640, 64), torch.bfloat16)] * 4
