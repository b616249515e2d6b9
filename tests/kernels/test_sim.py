"""The kernel on hf_tpu's simulated ``tpu`` device: same results as on CPU, static shapes, no host traffic."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("jax", reason="the ragged-dot kernel runs in JAX: pip install 'hf-tpu[kernels]'")

from ragged_helpers import kernel_ops, make_experts, routing, tiny_moe

import hf_tpu.sim


@pytest.fixture(autouse=True)
def _sim():
    hf_tpu.sim.enable()
    yield


def test_plain_kernels_selects_torch_tpu_on_the_simulator():
    from kernels import get_local_kernel

    from hf_tpu.kernels import RAGGED_DOT_REPO

    assert hasattr(torch.backends, "tpu")  # the simulator sets it (torch-tpu 0.2.0 does not; hf_tpu.enable() does)
    module = get_local_kernel(RAGGED_DOT_REPO)
    assert module.__file__.endswith("build/torch-tpu/ragged_dot_tpu/__init__.py")


def test_experts_on_the_simulator_match_cpu_with_static_shapes_and_no_host_traffic(kernel):
    cpu = make_experts(num_experts=8)
    dev = make_experts(num_experts=8).to("tpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=g)
    x_dev = x.to("tpu")
    with torch.no_grad():
        index, weights = routing("random", 4, 8, 2, g)
        kernel.experts_forward(dev, x_dev, index.to("tpu"), weights.to("tpu"))  # warm-up: first signatures
        for kind in ("random", "one_expert", "half_empty", "random"):
            index, weights = routing(kind, 4, 8, 2, g)
            index_dev, weights_dev = index.to("tpu"), weights.to("tpu")
            with hf_tpu.sim.stats() as s:
                out = kernel.experts_forward(dev, x_dev, index_dev, weights_dev)
            assert out.device.type == "tpu"
            assert (s.shape_signatures, s.host_syncs, s.h2d_copies, s.d2h_copies) == (0, 0, 0, 0), s.report()
            torch.testing.assert_close(out.cpu(), kernel.experts_forward(cpu, x, index, weights), atol=1e-6, rtol=0)
            with hf_tpu.sim.stats() as loop:
                dev.forward.__wrapped__(dev, x_dev, index_dev, weights_dev)  # transformers' eager loop
            assert loop.host_syncs > 0  # what the kernel avoids: the loop reads the routing on the host


def test_tiny_qwen3_moe_on_the_simulator_matches_cpu(tmp_path):
    from hf_tpu.kernels import use_ragged_dot_experts

    cls, config = tiny_moe("qwen3_moe")
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    name = use_ragged_dot_experts()
    cpu = cls.from_pretrained(tmp_path, experts_implementation="eager").eval()
    dev = cls.from_pretrained(tmp_path, experts_implementation=name).eval().to("tpu")
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = dev(ids.to("tpu")).logits
    assert logits.device.type == "tpu"
    with torch.no_grad():
        torch.testing.assert_close(logits.cpu(), cpu(ids).logits, atol=1e-5, rtol=1e-5)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    torch.testing.assert_close(dev.generate(ids.to("tpu"), **kwargs).cpu(), cpu.generate(ids, **kwargs))


SCHEMAS = {
    "ragged_dot": "(Tensor lhs, Tensor rhs, Tensor group_sizes, bool rhs_transposed, str implementation) -> Tensor",
    "moe_experts": "(Tensor hidden, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up, Tensor down, "
    "bool rhs_transposed, str implementation) -> Tensor",
}
_NAMESPACES = iter(range(1_000_000))


def _standin_jax_op(calls: list):
    """A stand-in for ``torch.tpu.pallas.jax_op`` in the shape of torch-tpu 0.2.0's
    (``torch_tpu/_internal/pallas/pallas.py``): ``jax_op("ns::name", fn, /, *, donate_argnums=None, mesh=None,
    input_partition_specs=None, output_partition_specs=None)`` needs a namespaced name and a JAX function whose
    every parameter is annotated, maps ``jax.Array`` parameters to tensors and the others to static arguments,
    and returns a ``torch.library.custom_op``. The device implementation runs the JAX function on the simulated
    tensors' host views (TorchTPU would export it for the TPU platform and run it on the chip)."""
    import inspect

    import jax

    torch_types = {jax.Array: "Tensor", bool: "bool", str: "str", int: "SymInt", float: "float"}

    def jax_op(name, fn=None, /, *, donate_argnums=None, mesh=None, input_partition_specs=None,
               output_partition_specs=None):  # fmt: skip
        if "::" not in name or len(name.split("::")) != 2:
            raise ValueError(f"Op name {name} does not contain a namespace.")
        signature = inspect.signature(inspect.unwrap(fn), eval_str=True)
        params = list(signature.parameters.values())
        if any(p.annotation is inspect.Parameter.empty for p in params):
            raise ValueError(f"Missing argument type annotation for JAX function: {signature}.")
        schema = "(" + ", ".join(f"{torch_types[p.annotation]} {p.name}" for p in params) + ") -> "
        schema += torch_types[signature.return_annotation]
        calls.append((name, schema))
        tensor_at = [p.annotation is jax.Array for p in params]

        def impl(*args):
            arrays = [
                jax.dlpack.from_dlpack(hf_tpu.sim.host_view(a).contiguous()) if is_tensor else a
                for a, is_tensor in zip(args, tensor_at, strict=True)
            ]
            result = torch.from_dlpack(fn(*arrays))
            out = torch.empty(result.shape, dtype=result.dtype, device="tpu")
            hf_tpu.sim.host_view(out).copy_(result)
            return out

        def fake(*args):
            def call(*arrays):  # the static arguments bound, as TorchTPU's jax.jit(static_argnums=...) does
                it = iter(arrays)
                return fn(*[next(it) if is_tensor else a for a, is_tensor in zip(args, tensor_at, strict=True)])

            tensors = [a for a, is_tensor in zip(args, tensor_at, strict=True) if is_tensor]
            out = jax.eval_shape(
                call, *[jax.ShapeDtypeStruct(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]
            )
            return torch.empty(out.shape, dtype=getattr(torch, str(out.dtype)), device=tensors[0].device)

        op = torch.library.custom_op(name, impl, mutates_args=(), schema=schema)
        op.register_fake(fake)
        return op

    return jax_op


@pytest.fixture
def torch_tpu_bridge(kernel, monkeypatch):
    """``torch.tpu.pallas`` as torch-tpu 0.2.0 exposes it (``get_pallas_mesh`` and ``jax_op``, nothing else), with
    the stand-in ``jax_op`` above; the kernel sees the simulated tensors as TorchTPU's. Each test gets its own op
    namespace, so every registration is its own. Yields the (name, schema) of every op registered."""
    import types

    ops = kernel_ops(kernel)
    calls = []
    pallas = types.ModuleType("torch.tpu.pallas", "Public Pallas API for TorchTPU (`torch.tpu.pallas`).")
    pallas.jax_op = _standin_jax_op(calls)
    pallas.get_pallas_mesh = lambda *a, **k: None
    pallas.__all__ = ["get_pallas_mesh", "jax_op"]
    monkeypatch.setattr(torch.tpu, "pallas", pallas, raising=False)
    monkeypatch.setattr(ops, "_host_view", lambda t: None)  # as if these were TorchTPU tensors
    monkeypatch.setattr(ops, "OP_NAMESPACE", f"{ops.OP_NAMESPACE}_standin{next(_NAMESPACES)}")
    monkeypatch.setattr(ops, "_TPU_OPS", {})
    return calls


def test_torch_tpu_branch_registers_through_jax_op_and_runs_there(kernel, torch_tpu_bridge):
    """Real-TPU branch: the kernel registers its JAX functions once with jax_op (annotated, so the schemas come out
    as below) and runs the grouped matmul through the registered op."""
    ns = kernel_ops(kernel).OP_NAMESPACE
    g = torch.Generator().manual_seed(0)
    lhs, rhs, sizes = torch.randn(12, 16, generator=g), torch.randn(3, 24, 16, generator=g), torch.tensor([4, 0, 8])
    expected = kernel.ragged_dot(lhs, rhs, sizes, rhs_transposed=True)
    for _ in range(2):  # registered once, however often it runs
        out = kernel.ragged_dot(
            lhs.to("tpu"), rhs.to("tpu"), sizes.to("tpu"), rhs_transposed=True, implementation="pallas_interpret"
        )
        assert out.device.type == "tpu"
        torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    assert torch_tpu_bridge == [(f"{ns}::{kind}_tpu", schema) for kind, schema in SCHEMAS.items()]


def test_torch_tpu_branch_runs_the_fused_experts_through_jax_op(kernel, torch_tpu_bridge):
    """The fused experts op on the real-TPU branch: the whole layer goes through the jax_op-registered op as one JAX
    function (weights as whole arrays), and comes back equal to the CPU result."""
    cpu = make_experts(num_experts=8)
    dev = make_experts(num_experts=8).to("tpu")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 32, generator=g)
    index, weights = routing("half_empty", 5, 8, 2, g)
    forward = kernel.make_experts_forward("pallas_interpret")
    with torch.no_grad():
        out = forward(dev, x.to("tpu"), index.to("tpu"), weights.to("tpu"))
        expected = kernel.experts_forward(cpu, x, index, weights)
    assert out.device.type == "tpu"
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    assert [name.split("::")[1] for name, _ in torch_tpu_bridge] == ["ragged_dot_tpu", "moe_experts_tpu"]


def test_jax_op_ops_trace_with_their_fake_implementation(kernel, torch_tpu_bridge):
    """The registered ops' fake implementations give the output shapes without running anything."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    registered = kernel_ops(kernel).torch_tpu_ops()
    with FakeTensorMode():
        out = registered["ragged_dot"](torch.empty(7, 16), torch.empty(3, 24, 16), torch.empty(3, dtype=torch.int32),
                                       True, "xla")  # fmt: skip
        assert out.shape == (7, 24)


@pytest.mark.parametrize(
    ("pallas", "match"),
    [
        ("absent", r"torch\.tpu\.pallas\.jax_op .*torch-tpu 0\.2"),
        ("custom_jax_kernel only", r"torch\.tpu\.pallas\.jax_op .*torch-tpu 0\.2"),
        ("no jax", r"jax_op .*failed to import .*pip install jax"),
    ],
)
def test_a_torch_tpu_without_jax_op_is_named_in_the_error(kernel, torch_tpu_bridge, monkeypatch, pallas, match):
    """What a TorchTPU without the public jax_op (older, or its pallas module failing to import jax) gives: an error
    naming torch.tpu.pallas.jax_op and the fix, not an AttributeError from deep inside."""
    import types

    if pallas == "absent":
        monkeypatch.setattr(torch.tpu, "pallas", types.ModuleType("torch.tpu.pallas"))
    elif pallas == "custom_jax_kernel only":  # the invented API the kernel used to call
        monkeypatch.setattr(torch.tpu, "pallas", types.SimpleNamespace(custom_jax_kernel=lambda *a, **k: None))
    else:

        class Pallas(types.ModuleType):
            def __getattr__(self, name):  # torch_tpu's lazy module imports pallas.py, which imports jax
                raise ImportError("JAX/Pallas is not available. Please install JAX to use this API.")

        monkeypatch.setattr(torch.tpu, "pallas", Pallas("torch.tpu.pallas"))
    with pytest.raises(RuntimeError, match=match):
        kernel.ragged_dot(torch.randn(4, 8).to("tpu"), torch.randn(2, 8, 3).to("tpu"), torch.tensor([2, 2]).to("tpu"))
    assert torch_tpu_bridge == []
    from hf_tpu.kernels._selftest import check_jax_op

    with pytest.raises(AssertionError, match="^jax_op: .*" + match):  # what hf-tpu selftest reports
        check_jax_op(kernel)


def test_selfcheck_lists_the_ops_registered_through_jax_op(kernel, torch_tpu_bridge):
    from hf_tpu.kernels._selftest import check_jax_op

    ns = kernel_ops(kernel).OP_NAMESPACE
    assert check_jax_op(kernel) == [f"{ns}::moe_experts_tpu", f"{ns}::ragged_dot_tpu"]
