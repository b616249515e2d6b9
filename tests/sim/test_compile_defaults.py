"""torch.compile on the simulator follows torch_tpu 0.2.0's patched torch.compile (``_loader._default_tpu_compile``).

No backend: graphs with tpu inputs go to the "tpu" backend (counted as compiles), ``dynamic`` defaults to False;
``backend="inductor"`` with tpu inputs raises torch_tpu's RuntimeError naming ``backend='tpu'``; CPU graphs keep
torch_tpu's default CPU backend. A compiled UNet's GroupNorm over a channels-last residual is refused as torch_tpu's
lowering refuses it, and runs and matches the CPU with hf_tpu's decomposition (hf_tpu._group_norm).
"""

import re

import pytest
import torch

import hf_tpu
import hf_tpu.sim
from hf_tpu.sim import _compile


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def test_compile_without_backend_uses_tpu_backend_and_matches_cpu():
    cpu = _model()
    x = torch.randn(3, 8)
    ref = cpu(x)
    dev = _model().to("tpu")
    compiled = torch.compile(dev)
    with hf_tpu.sim.stats() as s:
        out = compiled(x.to("tpu"))
        out2 = compiled(x.to("tpu"))
    assert s.compiles == 1  # the "tpu" backend ran (it counts), once
    torch.testing.assert_close(out.cpu(), ref)
    torch.testing.assert_close(out2.cpu(), ref)


def test_compile_without_backend_is_static_by_default():
    f = torch.compile(lambda a: (a * 2).sum(0))
    with hf_tpu.sim.stats() as s:
        for n in (2, 3, 4):
            torch.testing.assert_close(f(torch.ones(n, 5, device="tpu")).cpu(), torch.full((5,), 2.0 * n))
    assert s.compiles == 3  # dynamic=False: one graph per shape, as on torch_tpu (torch's default would go dynamic)


def test_explicit_dynamic_is_kept():
    f = torch.compile(lambda a: (a * 2).sum(0), dynamic=True)
    with hf_tpu.sim.stats() as s:
        for n in (2, 3, 4):
            f(torch.ones(n, 5, device="tpu"))
    assert s.compiles == 1


def test_inductor_on_tpu_inputs_raises_torch_tpus_error(capfd):
    f = torch.compile(lambda a: a * 2 + 1, backend="inductor")
    with pytest.raises(Exception) as info:
        f(torch.ones(3, device="tpu"))
    text = str(info.value)
    assert _compile.INDUCTOR_TPU_ERROR in text and "backend='tpu'" in text
    assert "jax" not in text
    captured = capfd.readouterr()
    assert len((captured.out + captured.err).splitlines()) < 10  # no pages of inductor log (issue #16)


def test_cpu_graphs_keep_the_default_cpu_backend():
    seen = []
    from torch._dynamo.backends import registry

    name = _compile.default_cpu_backend()
    original = registry.lookup_backend(name)

    def spy(gm, example_inputs, **kwargs):
        seen.append(name)
        return original(gm, example_inputs, **kwargs)

    registry._COMPILER_FNS[name] = spy
    try:
        out = torch.compile(lambda a: a.cos() + 1)(torch.zeros(3))
    finally:
        registry._COMPILER_FNS[name] = original
    torch.testing.assert_close(out, torch.full((3,), 2.0))
    assert seen == [name]


def test_compile_patch_is_reverted_by_disable():
    patched = torch.compile
    assert getattr(patched, "_hf_tpu_sim", False)
    hf_tpu.disable()
    try:
        assert not getattr(torch.compile, "_hf_tpu_sim", False)
        assert not getattr(torch._TorchCompileInductorWrapper.__call__, "_hf_tpu_sim", False)
    finally:
        hf_tpu.sim.enable()
    assert getattr(torch.compile, "_hf_tpu_sim", False)


def _unet():
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    ).eval()


def test_compiled_unet_with_attention_matches_cpu_with_contiguous_group_norm():
    """torch 2.13 hands native_group_norm the channels-last residual of the mid-block's attention in this graph;
    torch_tpu 0.2.0's lowering refuses it (its GroupNorm is torch's math_group_norm, which views the input; the same
    UNet through the wheel, checked by hand, and tests/contract/test_group_norm_layout.py's VAE), and so does the
    simulator. With the diffusers integration (hf_tpu._group_norm's decomposition) it runs and matches the CPU."""
    pytest.importorskip("diffusers")
    unet = _unet()
    x, t = torch.randn(1, 3, 16, 16), torch.tensor([10])
    with torch.no_grad():
        ref = unet(x, t).sample
        unet.to("tpu")
        with pytest.raises(RuntimeError, match=r"view\(\): cannot create a view of shape \[1, 8, 512\]"):
            torch.compile(unet, backend="tpu", fullgraph=True)(x.to("tpu"), t.to("tpu"))
        torch._dynamo.reset()
        with hf_tpu.enabled("diffusers"):
            out = torch.compile(unet, backend="tpu", fullgraph=True)(x.to("tpu"), t.to("tpu")).sample.cpu()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_group_norm_on_strided_views_forward_and_backward_match_cpu():
    x = torch.randn(2, 6, 5, 4).permute(0, 1, 3, 2)  # not contiguous in any memory format the CPU kernel accepts
    w, b = torch.randn(6), torch.randn(6)
    xc = x.detach().requires_grad_()
    ref = torch.ops.aten.native_group_norm(xc.contiguous(), w, b, 2, 6, 20, 3, 1e-5)[0]
    ref.sum().backward()
    xt = x.to("tpu").requires_grad_()
    assert not xt.is_contiguous()  # .to() kept the strides
    out = torch.ops.aten.native_group_norm(xt, w.to("tpu"), b.to("tpu"), 2, 6, 20, 3, 1e-5)[0]
    out.sum().backward()
    torch.testing.assert_close(out.cpu(), ref)
    torch.testing.assert_close(xt.grad.cpu(), xc.grad)


def _checked_double(ids, features):
    n = (ids == 5).sum()  # a tensor check, as transformers' torch_compilable_check makes it while compiling
    torch._check_tensor_all(n * features.shape[-1] == features.numel())
    return features * 2


def test_a_graph_reading_a_device_value_on_the_host_is_refused_as_torch_tpu_refuses_it(caplog):
    """torch_tpu refuses to lower a graph holding ``aten._local_scalar_dense`` (a tensor check, ``.item()``,
    ``.tolist()`` of a value computed in it: "local_scalar_dense(): cannot record EventSnapshot during an FX trace",
    met by tests/contract on LFM3-VL's vision graph before hf_tpu folded its reads); the simulator refuses it with the
    same words and the read's source line, logged once per line. hf_tpu's loops read that refusal as "not one graph"
    (the route's reason names it). A graph without the read compiles and runs."""
    from hf_tpu.sim import _backend
    from hf_tpu.transformers._graphs import _not_one_graph

    ids, features = torch.tensor([[5, 1, 5]]), torch.randn(1, 2, 4)
    _backend._HOST_READ_SITES.clear()
    before = len(hf_tpu.sim.host_reads())
    refused = []
    with caplog.at_level("WARNING", logger="hf_tpu.sim"):
        for _ in range(2):
            torch._dynamo.reset()
            with pytest.raises(Exception, match=re.escape(_backend.HOST_READ_REFUSAL)) as caught:
                torch.compile(_checked_double, backend="tpu", fullgraph=True)(ids.to("tpu"), features.to("tpu"))
            refused.append(caught.value)
        out = torch.compile(lambda x: x * 2, backend="tpu", fullgraph=True)(features.to("tpu"))
    torch.testing.assert_close(out.cpu(), features * 2)
    assert "test_compile_defaults.py" in str(refused[0]) and "_check_tensor_all" in str(refused[0]), refused[0]
    reason = _not_one_graph(refused[0])
    assert reason.startswith("torch_tpu refuses graphs that read a device value on the host (local_scalar_dense at")
    assert "test_compile_defaults.py:" in reason, reason
    logged = [r.getMessage() for r in caplog.records if "reads a device value on the host" in r.getMessage()]
    assert len(logged) == 1, logged  # once for the line, not again for its second compile; none for the plain graph
    assert "test_compile_defaults.py" in logged[0] and _backend.HOST_READ_REFUSAL in logged[0], logged[0]
    # hf_tpu.sim.host_reads: one site per refused graph (both compiles of the checked graph; the plain one adds none)
    sites = hf_tpu.sim.host_reads()[before:]
    assert len(sites) == 2 and sites[0] == sites[1] and "test_compile_defaults.py" in sites[0], sites
    # the sweeps count a row whose graphs read the host as missing its targets (tables read back from docs keep the
    # reason's words)
    from hf_tpu.benchmarks import arch_sweep

    row = {"status": "fast path", "identical": True, "compiles_2nd": 0, "signatures_2nd": 0, "h2d_per_step": 1.0,
           "d2h_per_step": 1.0}  # fmt: skip
    assert arch_sweep.misses(row) == [] and arch_sweep.host_read_note([]) == ""
    note = arch_sweep.host_read_note(sites)
    assert "test_compile_defaults.py:" in note and "2 graphs" in note, note
    assert arch_sweep.misses({**row, "host_reads": 2}) == ["host reads in compiled graphs"]
    assert arch_sweep.misses({**row, "reason": note}) == ["host reads in compiled graphs"]


def test_a_boolean_mask_index_in_a_compiled_graph_counts_as_a_host_read():
    """``x[mask]`` shapes its result by the mask's count of True: torch_tpu computes that with ``nonzero`` while it
    lowers the graph and refuses ("nonzero(): cannot record EventSnapshot during an FX trace": the contract tier's
    Qwen3-VL image prefill before hf_tpu.transformers._deepstack); the simulator refuses it alike and records it with
    the host reads. The same sum through ``masked_scatter`` (a static shape) compiles and records nothing."""
    x, mask = torch.randn(2, 5, 4), torch.tensor([[True, False, True, False, False], [False] * 4 + [True]])
    rows = torch.randn(3, 4)
    before = len(hf_tpu.sim.host_reads())
    with pytest.raises(Exception, match=r"nonzero\(\): cannot record EventSnapshot during an FX trace"):
        torch.compile(lambda x, m: x[m] * 2, backend="tpu", fullgraph=True)(x.to("tpu"), mask.to("tpu"))
    assert len(hf_tpu.sim.host_reads()) == before + 1, hf_tpu.sim.host_reads()[before:]

    def scattered(x, m, rows):
        return x + torch.zeros_like(x).masked_scatter(m[..., None].expand_as(x), rows)

    got = torch.compile(scattered, backend="tpu", fullgraph=True)(x.to("tpu"), mask.to("tpu"), rows.to("tpu"))
    torch.testing.assert_close(got.cpu(), scattered(x, mask, rows))
    assert len(hf_tpu.sim.host_reads()) == before + 1

    # assignments through a mask, as the wheel takes them (tests/contract's lower_host_reads): one value or a row
    # broadcast to the masked positions compiles; a row per masked position is refused ("index_put_(): ...")
    def filled(x, m):
        y = x.clone()
        y[m] = 0
        y[m.all(dim=-1)] = x[0, 0]
        return y

    def rows_put(x, m, rows):
        y = x.clone()
        y[m] = rows
        return y

    got = torch.compile(filled, backend="tpu", fullgraph=True)(x.to("tpu"), mask.to("tpu"))
    torch.testing.assert_close(got.cpu(), filled(x, mask))
    assert len(hf_tpu.sim.host_reads()) == before + 1
    with pytest.raises(Exception, match=r"index_put_\(\): cannot record EventSnapshot during an FX trace"):
        torch.compile(rows_put, backend="tpu", fullgraph=True)(x.to("tpu"), mask.to("tpu"), rows.to("tpu"))
    assert len(hf_tpu.sim.host_reads()) == before + 2
