"""``torch.tpu`` on the simulator has torch_tpu 0.2.0's surface and refuses what torch_tpu reserves for torch.

torch_tpu's ``annotations.internal_or_experimental`` makes device_count/is_available/current_device/set_device/
synchronize/current_stream/set_stream/device (torch >= 2.11) and initial_seed/get_rng_state (>= 2.13) raise when
user code calls them; torch itself (torch.accelerator, torch.random, autocast, checkpointing) still may.
"""

import importlib.util
import subprocess
import sys

import pytest
import torch

import hf_tpu.sim

# torch_tpu._internal.public_api._PUBLIC_MODULES["torch.tpu"].exports, as the 0.2.0 wheel lists them (the contract
# tier checks this list against the installed wheel: tests/contract/test_simulator_vs_wheel.py).
WHEEL_EXPORTS = {
    "EagerMode", "Event", "Precision", "Stream", "allow_excess_precision", "current_device", "current_stream",
    "default_generators", "default_stream", "device", "device_count", "device_of", "eager_mode",
    "get_amp_supported_dtype", "get_device_name", "get_device_properties", "get_rng_state", "initial_seed",
    "is_available", "is_initialized", "manual_seed", "manual_seed_all", "precision", "set_device", "set_eager_mode",
    "set_rng_state", "set_stream", "stream", "synchronize", "topology_aware_mesh",
}  # fmt: skip
# Exported by torch_tpu but not modelled by the simulator (execution modes, XLA options, meshes).
NOT_SIMULATED = {"EagerMode", "allow_excess_precision", "eager_mode", "set_eager_mode", "topology_aware_mesh"}
INTERNAL = {
    "device_count": ("torch.accelerator.device_count", ()),
    "is_available": ("torch.accelerator.is_available", ()),
    "current_device": ("torch.accelerator.current_device_index", ()),
    "set_device": ("torch.accelerator.set_device_index", (0,)),
    "synchronize": ("torch.accelerator.synchronize", ()),
    "current_stream": ("torch.accelerator.current_stream", ()),
    "initial_seed": ("torch.accelerator.random.initial_seed", ()),
    "get_rng_state": ("torch.accelerator.random.get_rng_state", ()),
}


def public_names() -> set[str]:
    return {n for n in vars(torch.tpu) if not n.startswith("_") and not isinstance(getattr(torch.tpu, n), type(torch))}


def test_public_names_are_the_wheels():
    names = public_names()
    assert names <= WHEEL_EXPORTS, f"the simulator's torch.tpu has names torch_tpu lacks: {names - WHEEL_EXPORTS}"
    assert WHEEL_EXPORTS - NOT_SIMULATED <= names
    for gone in ("seed", "seed_all", "get_rng_state_all", "empty_cache", "memory_allocated", "mem_get_info"):
        assert not hasattr(torch.tpu, gone)


@pytest.mark.parametrize("name", sorted(INTERNAL))
def test_user_calls_to_internal_functions_raise_torch_tpus_error(name):
    prefer, args = INTERNAL[name]
    with pytest.raises(RuntimeError) as info:
        getattr(torch.tpu, name)(*args)
    assert str(info.value) == (
        f"{name} is internal to TorchTPU and can only be called by the PyTorch framework (torch and torch_tpu). "
        f"Use {prefer} instead."
    )
    with pytest.raises(RuntimeError, match="torch.accelerator.device_index"):
        torch.tpu.device(0)


def test_torch_itself_still_reaches_the_device_module():
    assert torch.accelerator.device_count() == 1 and torch.accelerator.is_available()
    torch.manual_seed(7)  # torch.random seeds the device through torch.tpu.manual_seed_all
    a = torch.rand(3, device="tpu").cpu()
    with torch.random.fork_rng(device_type="tpu"):  # torch.random calls device_count/get_rng_state/set_rng_state
        b = torch.rand(3, device="tpu").cpu()
    c = torch.rand(3, device="tpu").cpu()
    torch.manual_seed(7)
    assert torch.equal(a, torch.rand(3, device="tpu").cpu())
    assert torch.equal(b, torch.rand(3, device="tpu").cpu()) and torch.equal(b, c)
    with torch.autocast("tpu"):
        assert (torch.ones(2, 2, device="tpu") @ torch.ones(2, 2, device="tpu")).dtype == torch.bfloat16
    with torch.tpu.device_of(torch.ones(1, device="tpu")):  # torch_tpu's own code may use the internal ones
        pass
    compiled = torch.compile(lambda x: x + torch.tpu.device_count(), backend="tpu")  # not checked while tracing
    assert compiled(torch.zeros(1, device="tpu")).cpu().item() == 1.0


def test_legacy_env_var_turns_the_error_into_a_warning():
    code = (
        "import warnings, torch, hf_tpu.sim\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    assert torch.tpu.device_count() == 1 and torch.tpu.device_count() == 1\n"
        "assert len(w) == 1 and 'torch.accelerator.device_count' in str(w[0].message), [str(x.message) for x in w]\n"
    )
    env = {**__import__("os").environ, "TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_tpu_generator_works_and_unsupported_ops_raise_hf_tpu_errors():
    g = torch.Generator("tpu").manual_seed(3)
    assert g.device == torch.device("tpu", 0) and isinstance(g, torch.Generator)
    assert isinstance(torch.default_generator, torch.Generator)
    a = torch.randn(4, device="tpu", generator=g).cpu()
    assert torch.equal(a, torch.randn(4, generator=torch.Generator().manual_seed(3)))
    x = torch.randn(3, 3, device="tpu")
    x.normal_(generator=g.manual_seed(5))
    assert torch.equal(x.cpu(), torch.empty(3, 3).normal_(generator=torch.Generator().manual_seed(5)))
    with pytest.raises(RuntimeError, match="one device"):
        torch.Generator("tpu:1")
    # (a CSR tensor can be moved over, as torch builds it from its dense parts; every op on it is refused)
    for make in (
        lambda: torch.randn(3, 3).to_sparse().to("tpu"),
        lambda: torch.randn(3, 3).to_sparse_csr().to("tpu").sum(),
    ):
        with pytest.raises(NotImplementedError, match="sparse|sparse_coo") as info:
            make()
        assert "PrivateUse1HooksInterface" not in str(info.value) and "Sparsetpu" not in str(info.value)
        assert "simulated tpu device" in str(info.value)
    # a dense tpu tensor's to_sparse() reaches torch_tpu's missing-op fallback (aten::_to_sparse has no kernel)
    with pytest.raises(RuntimeError, match=r"operator 'aten::_to_sparse' is not implemented for TPU") as info:
        x.to_sparse()
    assert "simulated tpu device" in str(info.value)


def test_storage_resize_works_with_the_native_core_and_is_refused_on_the_python_path(monkeypatch):
    from hf_tpu.sim._counters import STATE

    if STATE.native is not None:
        cpu = torch.arange(6.0)
        t = cpu.to("tpu")
        before = hf_tpu.sim.memory_allocated()
        kept = 24  # the bytes that every resize so far has kept
        for size in (48, 8, 0, 16):  # grow, shrink, empty, grow again: as on the CPU
            t.untyped_storage().resize_(size)
            cpu.untyped_storage().resize_(size)
            assert t.untyped_storage().nbytes() == size
            assert hf_tpu.sim.memory_allocated() == before - 24 + size
            kept = min(kept, size)
            keep = kept // 4
            if keep:
                dev = torch.empty(0, device="tpu").set_(t.untyped_storage(), 0, (keep,), (1,))
                assert torch.equal(dev.cpu(), torch.empty(0).set_(cpu.untyped_storage(), 0, (keep,), (1,)))
        u = torch.ones(4, device="tpu")
        (u * 2).sum()  # a cached host view of u's storage exists now
        u.untyped_storage().resize_(32)
        assert torch.equal((u * 3).cpu(), torch.full((4,), 3.0))  # read from the new memory
    storage = torch.ones(2, device="tpu").untyped_storage()
    monkeypatch.setattr(STATE, "native", None)  # the Python path (no compiler), at the point of the call
    with pytest.raises(NotImplementedError, match=r"resize_\(0\) is not supported on the simulated tpu device"):
        storage.resize_(0)


def test_views_with_storage_offsets_match_cpu():
    base = torch.arange(24.0)
    t = base.to("tpu")
    for view in (lambda b: b[5:17], lambda b: b[3:].view(3, 7), lambda b: b.as_strided((3, 4), (5, 1), 2),
                 lambda b: b.view(4, 6)[1:, 2:].t()):  # fmt: skip
        v = view(t)
        assert v.storage_offset() == view(base).storage_offset()
        assert torch.equal(v.cpu(), view(base)) and torch.equal((v * 2).cpu(), view(base) * 2)
    y = torch.empty(0, device="tpu").set_(t.untyped_storage(), 4, (5,), (3,))
    assert torch.equal(y.cpu(), base[4::3][:5])
    y.add_(1)  # writes through to the shared storage
    assert torch.equal(t.cpu()[4:19:3], base[4:19:3] + 1)
    hf_tpu.sim.host_view(t).zero_()


def test_the_torch_accelerator_equivalents_work():
    """What the refusals point to must work on the simulator (torch's own fail for a Python backend)."""
    hf_tpu.sim.enable(hbm=64 * 1024**2)
    base = hf_tpu.sim.memory_allocated()
    torch.accelerator.reset_peak_memory_stats()
    x = torch.zeros(1024, 1024, device="tpu")  # 4 MiB
    torch.accelerator.synchronize()
    torch.accelerator.synchronize(0)
    assert torch.accelerator.memory_allocated() == base + x.nbytes == hf_tpu.sim.memory_allocated()
    assert torch.accelerator.max_memory_allocated() >= base + x.nbytes
    free, total = torch.accelerator.get_memory_info()
    assert total == 64 * 1024**2 and free == total - base - x.nbytes
    del x
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == torch.accelerator.memory_allocated() == base
    with pytest.raises(RuntimeError, match="tpu:1 does not exist"):
        torch.accelerator.synchronize(1)


def test_torch_accelerator_answers_stay_with_the_device_after_disable():
    """``hf_tpu.disable()`` leaves the ``tpu`` device registered (torch cannot unregister it) and current: upstream
    code that asks torch.accelerator (accelerate 1.16's ``clear_device_cache``) must still get answers, not torch's
    internal assert about a missing device allocator."""
    hf_tpu.sim.enable()
    x = torch.ones(256, device="tpu")
    hf_tpu.disable()
    try:
        assert torch.accelerator.current_accelerator().type == "tpu"
        torch.accelerator.empty_cache()
        torch.accelerator.synchronize()
        assert torch.accelerator.memory_allocated() == hf_tpu.sim.memory_allocated() >= x.nbytes
        if importlib.util.find_spec("accelerate") is not None:
            from accelerate.utils.memory import clear_device_cache

            clear_device_cache(garbage_collection=True)
    finally:
        hf_tpu.sim.enable()


def test_diffusers_draws_latents_with_a_tpu_generator():
    pytest.importorskip("diffusers")
    from diffusers.utils.torch_utils import randn_tensor

    latents = randn_tensor((2, 4, 8, 8), generator=torch.Generator("tpu").manual_seed(0), device=torch.device("tpu"))
    assert latents.device.type == "tpu"
    assert torch.equal(latents.cpu(), torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(0)))


def test_subclasses_of_torch_generator_still_work():
    class Reporting(torch.Generator):
        @property
        def device(self):
            return torch.device("cpu")

    g = Reporting()
    assert type(g) is Reporting and isinstance(g, torch.Generator) and issubclass(Reporting, torch.Generator)
    ref = torch.rand(3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.rand(3, generator=g.manual_seed(1)), ref)
