"""scripts/chip_torch_tpu.py: hf_tpu with torch_tpu itself on a chip. Its stage specs, what ``pack`` takes of
torch_tpu, and the ``generate`` stage on the simulated device (the stages that need torch_tpu's runtime run on a chip
only: docs/chip_v5e_torch_tpu.jsonl holds their records)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _timeouts import SAFETY_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "chip_torch_tpu.py"


def _script():
    spec = importlib.util.spec_from_file_location("chip_torch_tpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stage_specs():
    s = _script()
    assert s.parse_stage("experts:200:SHAPE=mixtral,TOKENS=1_8_512") == (
        "experts", 200, {"SHAPE": "mixtral", "TOKENS": "1_8_512"})
    assert s.parse_stage("basics") == ("basics", 120, {})
    assert all(s.parse_stage(spec)[0] in s.STAGES for spec in s.DEFAULT_STAGES)
    with pytest.raises(ValueError, match="unknown stage 'expert'"):
        s.parse_stage("expert:10")
    with pytest.raises(ValueError, match="is not ENV=VALUE"):
        s.parse_stage("experts:10:SHAPE")


def test_pack_takes_torch_tpu_for_torch_2_13_only(tmp_path):
    s = _script()
    for rel in ("torch_tpu/__init__.py", "torch_tpu/_internal/compile/tpu_torch_compile_2_13_0.so",
                "torch_tpu/_internal/compile/tpu_torch_compile_2_14_0.so", "torch_tpu/csrc/common/libxla_base.so",
                "torch_tpu/csrc/common/glue_2_11_0/libpywrap_2_11_0_common.so", "torch_tpu/__pycache__/x.pyc",
                "torch_tpu-0.2.0.dist-info/METADATA", "torch-2.13.0.dist-info/METADATA"):  # fmt: skip
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert s.torch_tpu_members(tmp_path) == [
        "torch_tpu/__init__.py", "torch_tpu/_internal/compile/tpu_torch_compile_2_13_0.so",
        "torch_tpu/csrc/common/libxla_base.so", "torch_tpu-0.2.0.dist-info/METADATA"]  # fmt: skip


@pytest.mark.slow
def test_generate_stage_on_the_simulator(tmp_path):
    """The generate stage as a chip runs it, on the simulated device: its records say the tokens equal the CPU's, for
    the tiny Llama and for the MoE with the Hub kernel in every graph (its XLA form: the Pallas ones need a chip)."""
    env = dict(os.environ, HF_TPU_SIMULATE="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--out", str(tmp_path), "--stages", "generate:900",
                           "generate:900:CASE=moe_kernel,KERNEL_IMPL=xla"], env=env, capture_output=True, text=True,
                          timeout=SAFETY_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    runs = [r for r in records if r["step"] == "generate"]
    cases = [(r["case"], r["batch"]) for r in runs]
    assert cases == [("llama", 1), ("llama", 4), ("moe_kernel", 1), ("moe_kernel", 4)]
    assert all(r["equal"] for r in runs)
    assert {r["experts"] for r in runs if r["case"] == "moe_kernel"} == {"chip_kernel"}


def test_decode_models_are_the_lean_steps_shapes_and_the_lean_stage_runs_jax_alone(tmp_path, monkeypatch):
    """The decode stage's models are the shapes of chip_bench.py's lean JAX steps (the rows' references, measured in
    the same command by the ``lean`` stage); that stage runs in the machine's own JAX (its libtpu, the chip not kept
    from JAX), the torch_tpu stages with libtpu 0.0.52 first and JAX on the CPU."""
    import transformers

    s = _script()
    sys.path.insert(0, str(ROOT / "scripts"))
    import chip_bench

    for name, lean in (("llama", chip_bench.LLAMA_1B), ("qwen3_moe", chip_bench.QWEN3_MOE)):
        config_class, fields = s.DECODE_MODELS[name]
        c = getattr(transformers, config_class)(**fields)
        got = {"vocab": c.vocab_size, "hidden": c.hidden_size, "layers": c.num_hidden_layers,
               "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
               "tied": c.tie_word_embeddings}  # fmt: skip
        if name == "llama":
            got["intermediate"] = c.intermediate_size
        else:
            got.update(intermediate=c.moe_intermediate_size, experts=c.num_experts, top_k=c.num_experts_per_tok)
        assert got == lean, name
    monkeypatch.setattr(s, "CHIP_HOME", tmp_path)
    (tmp_path / "site").mkdir()
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    torch_tpu_env, lean_env = s.stage_env("llama_decode"), s.stage_env("lean")
    assert torch_tpu_env["JAX_PLATFORMS"] == "cpu" and torch_tpu_env["PYTHONPATH"].startswith(str(tmp_path / "libtpu"))
    assert "JAX_PLATFORMS" not in lean_env and lean_env["PYTHONPATH"] == str(ROOT)
    assert s.parse_stage("lean:200:BATCHES=1_64,MODELS=llama+moe") == ("lean", 200, {"BATCHES": "1_64",
                                                                                   "MODELS": "llama+moe"})


def test_the_prefill_flops_are_what_torchs_flop_counter_counts():
    """The prefill stage's FLOPs (its MFU's numerator): the projections and the last token's LM head equal torch's
    count of a forward with one row of logits; eager attention (QK^T and PV as whole products) counts the causal
    triangle twice."""
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    s = _script()
    config_class, fields = s.SMOKE_MODEL
    config = getattr(transformers, config_class)(**fields)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    tokens = 48
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, config.vocab_size, (1, tokens)), logits_to_keep=1)
    flops = s.prefill_flops(config, tokens)
    assert flops["total"] == flops["linear"] + flops["attention"] + flops["head"]
    assert counter.get_total_flops() == flops["linear"] + flops["head"] + 2 * flops["attention"]


@pytest.mark.slow
def test_the_serve_stage_loads_a_server_over_a_unix_socket_on_the_simulator(tmp_path):
    """The serve stage as a chip runs it, on the simulated device with the smoke model: the server on a unix socket
    answers every stream of each load with its tokens, compiles nothing after its warm-up, and the second server on
    the same compile cache compiles no graph."""
    env = dict(os.environ, HF_TPU_SIMULATE="1", MODEL="smoke", WORK=str(tmp_path / "work"), STREAMS="1 3", PROMPT="12",
               NEW="8", FLAGS="--slots+4+--kv-cache-gib+0.05+--min-step-tokens+64+--max-batch-tokens+64")  # fmt: skip
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--out", str(tmp_path / "out"), "--stages", "serve:900"],
                          env=env, capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    loads = [r for r in records if r["step"] == "load"]
    assert [(r["streams"], r["answered"], r["tokens"]) for r in loads] == [(1, 1, 8), (3, 3, 24)]
    assert all(r["compiles_after_warmup"] == 0 and r["tokens_per_s"] > 0 for r in loads)
    ready = {r["attempt"]: r for r in records if r["step"] == "ready"}
    assert ready["first"]["graphs_compiled"] == ready["first"]["step_shapes"] > 0
    assert ready["cached"]["graphs_compiled"] == 0


def test_the_mmdit_and_training_flops_are_what_torchs_flop_counter_counts():
    """The denoiser and train stages' FLOPs (their MFU's numerators, and the lean JAX records'): an SD3 MMDiT forward
    (MMDiT-X blocks, the last block's text stream cut short, attention through sdpa's math path) and a Llama training
    step (forward and backward, eager attention: whole squares, so the causal triangle counts twice) equal torch's
    count; SD3.5-medium's shape is one config in both scripts and builds in diffusers."""
    import torch
    import transformers
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    s = _script()
    sys.path.insert(0, str(ROOT / "scripts"))
    import chip_bench

    assert chip_bench.SD35_MEDIUM == s.SD35_MEDIUM
    with torch.device("meta"):
        full = SD3Transformer2DModel(**s.SD35_MEDIUM)
    assert 2.2e9 < sum(p.numel() for p in full.parameters()) < 2.6e9  # SD3.5-medium's 2.5B with the position table
    for layers in (3, 1):
        cfg = dict(s.SMOKE_MMDIT, num_layers=layers, dual_attention_layers=(0,) if layers > 1 else ())
        model = SD3Transformer2DModel(**cfg).eval()
        batch, height, width, text = 2, 8, 12, 20
        with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            model(hidden_states=torch.randn(batch, 16, height, width),
                  encoder_hidden_states=torch.randn(batch, text, cfg["joint_attention_dim"]),
                  pooled_projections=torch.randn(batch, cfg["pooled_projection_dim"]),
                  timestep=torch.full((batch,), 500.0))  # fmt: skip
        flops = s.mmdit_flops(cfg, height, width, text, batch)
        assert counter.get_total_flops() == flops["total"] == flops["linear"] + flops["attention"], layers
    for guidance in (True, False):  # the Flux shape (SHAPE=flux): double- and single-stream blocks
        cfg = dict(s.SMOKE_FLUX, guidance_embeds=guidance)
        model = FluxTransformer2DModel(**cfg).eval()
        batch, image, text = 2, 24, 10
        kwargs = dict(hidden_states=torch.randn(batch, image, cfg["in_channels"]),
                      encoder_hidden_states=torch.randn(batch, text, cfg["joint_attention_dim"]),
                      pooled_projections=torch.randn(batch, cfg["pooled_projection_dim"]),
                      timestep=torch.full((batch,), 0.5), txt_ids=torch.zeros(text, 3), img_ids=torch.randn(image, 3),
                      guidance=torch.full((batch,), 3.5) if guidance else None)  # fmt: skip
        with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            model(**kwargs)
        assert counter.get_total_flops() == s.flux_flops(cfg, image, text, batch)["total"], guidance
    with torch.device("meta"):
        flux = FluxTransformer2DModel(**s.FLUX_DEV)
        fit = FluxTransformer2DModel(**dict(s.FLUX_DEV, num_layers=s.FLUX_FIT[0], num_single_layers=s.FLUX_FIT[1]))
    assert 11.8e9 < sum(p.numel() for p in flux.parameters()) < 12e9  # FLUX.1-dev's 12B
    assert sum(p.numel() for p in fit.parameters()) * 2 < 0.7 * 15.75 * 2**30  # its bf16 weights leave room on a v5e
    config_class, fields = s.SMOKE_MODEL
    config = getattr(transformers, config_class)(**fields)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    flops = s.train_flops(config, 2, 24)
    assert counter.get_total_flops() == flops["linear"] + 2 * flops["attention"]
    assert flops["linear"] == 6 * flops["matmul_params"] * 2 * 24
    state = s.train_state_bytes(getattr(transformers, config_class)(**s.DECODE_MODELS["llama"][1]))
    assert 1.23e9 < state["params"] < 1.24e9 and state["total"] == 8 * state["params"]  # Llama-3.2-1B: 1.236B


def test_the_lean_jax_mmdit_and_training_step_compute_what_diffusers_and_transformers_do():
    """chip_bench.py's lean references of the denoiser and train stages are the same models: the MMDiT forward
    (given diffusers' SD3 transformer's weights, its biases and position table zeroed, as the lean step has none)
    equals ``SD3Transformer2DModel``'s output (with its plain attention and with the TPU's flash kernel, run in its
    interpret mode), and the training step's loss equals the Llama's loss, then falls."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from diffusers import SD3Transformer2DModel
    from jax.experimental.pallas import tpu as pltpu

    s = _script()
    sys.path.insert(0, str(ROOT / "scripts"))
    import chip_bench

    cfg = dict(s.SMOKE_MMDIT)
    torch.manual_seed(0)
    model = SD3Transformer2DModel(**cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
        model.pos_embed.pos_embed.zero_()

    def t(linear):
        return jnp.asarray(linear.weight.detach().numpy().T)

    def qkv(a, b, c):
        return jnp.concatenate([t(a), t(b), t(c)], 1)

    tte = model.time_text_embed
    params = {"patch": jnp.asarray(model.pos_embed.proj.weight.detach().reshape(model.inner_dim, -1).numpy().T),
              "t1": t(tte.timestep_embedder.linear_1), "t2": t(tte.timestep_embedder.linear_2),
              "y1": t(tte.text_embedder.linear_1), "y2": t(tte.text_embedder.linear_2),
              "ctx": t(model.context_embedder), "out_mod": t(model.norm_out.linear), "out": t(model.proj_out),
              "blocks": []}  # fmt: skip
    for block in model.transformer_blocks:
        a = block.attn
        entry = {"mod": t(block.norm1.linear), "cmod": t(block.norm1_context.linear),
                 "qkv": qkv(a.to_q, a.to_k, a.to_v), "cqkv": qkv(a.add_q_proj, a.add_k_proj, a.add_v_proj),
                 "o": t(a.to_out[0]), "ff1": t(block.ff.net[0].proj), "ff2": t(block.ff.net[2])}  # fmt: skip
        if not block.context_pre_only:
            entry.update(co=t(a.to_add_out), cff1=t(block.ff_context.net[0].proj), cff2=t(block.ff_context.net[2]))
        if block.attn2 is not None:
            entry.update(qkv2=qkv(block.attn2.to_q, block.attn2.to_k, block.attn2.to_v), o2=t(block.attn2.to_out[0]))
        params["blocks"].append(entry)
    g = torch.Generator().manual_seed(1)
    latents, text = torch.randn(2, 16, 8, 12, generator=g), torch.randn(2, 20, cfg["joint_attention_dim"], generator=g)
    pooled, timestep = torch.randn(2, cfg["pooled_projection_dim"], generator=g), torch.tensor([500.0, 20.0])
    with torch.no_grad():
        want = model(hidden_states=latents, encoder_hidden_states=text, pooled_projections=pooled, timestep=timestep,
                     return_dict=False)[0].numpy()  # fmt: skip
    inputs = [jnp.asarray(x.numpy()) for x in (latents, text, pooled, timestep)]
    got = np.asarray(jax.jit(chip_bench.mmdit_forward(cfg))(params, *inputs))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-3)
    with pltpu.force_tpu_interpret_mode():  # the TPU's flash kernel (padded, masked: 44 and 24 tokens) on CPU
        flash = np.asarray(jax.jit(chip_bench.mmdit_forward(cfg, "flash"))(params, *inputs))
    np.testing.assert_allclose(flash, want, atol=2e-4, rtol=1e-3)

    lean_cfg = dict(chip_bench.LLAMA_1B, layers=2, vocab=256, hidden=64, intermediate=128, heads=4, kv_heads=2,
                    head_dim=16)  # fmt: skip
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_theta=500000.0,
        rms_norm_eps=1e-6))  # fmt: skip
    lean = {"embed": jnp.asarray(llama.model.embed_tokens.weight.detach().numpy()), "layers": [],
            "norm": jnp.asarray(llama.model.norm.weight.detach().numpy())}  # fmt: skip
    for layer in llama.model.layers:
        at, mlp = layer.self_attn, layer.mlp
        lean["layers"].append({"ln1": jnp.asarray(layer.input_layernorm.weight.detach().numpy()),
                               "ln2": jnp.asarray(layer.post_attention_layernorm.weight.detach().numpy()),
                               "wq": t(at.q_proj), "wk": t(at.k_proj), "wv": t(at.v_proj), "wo": t(at.o_proj),
                               "gate_up": jnp.concatenate([t(mlp.gate_proj), t(mlp.up_proj)], 1),
                               "down": t(mlp.down_proj)})  # fmt: skip
    ids = torch.randint(0, 256, (2, 24), generator=g)
    with torch.no_grad():
        want_loss = float(llama(input_ids=ids, labels=ids).loss)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, lean)
    step = chip_bench.lean_train_step(lean_cfg, lr=1e-2)
    state = {"m": zeros, "v": jax.tree_util.tree_map(jnp.zeros_like, lean), "count": jnp.int32(0)}
    lean, state, loss = step(lean, state, jnp.asarray(ids.numpy(), jnp.int32))
    assert abs(float(loss) - want_loss) < 1e-4
    assert float(step(lean, state, jnp.asarray(ids.numpy(), jnp.int32))[2]) < float(loss)


def test_the_lean_mmdit_flash_attention_pads_and_masks_to_the_plain_attention():
    """The lean MMDiT's flash attention on a TPU (chip_bench._flash_attend: the Pallas kernel, run here in its
    interpret mode) over 200 tokens, padded to 256 (one block of 256, two of 128) with the padding masked out, equals
    the plain softmax attention over the 200."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas import tpu as pltpu

    sys.path.insert(0, str(ROOT / "scripts"))
    import chip_bench

    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, 200, 2 * 64), jnp.float32) for i in range(3))
    want = np.asarray(chip_bench._attend(q, k, v, 2))
    for block in (512, 128):
        with pltpu.force_tpu_interpret_mode():
            got = np.asarray(chip_bench._flash_attend(q, k, v, 2, block))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_the_denoiser_and_train_stages_on_the_simulator(tmp_path):
    """The denoiser (SD3 and SHAPE=flux) and train stages as a chip runs them, with MODEL=smoke on the simulated
    device: every record comes, each pipeline's second call and the denoiser's timed steps compile nothing, the tiny
    pipelines' images equal the CPU's, the Trainer's steps after the second compile nothing, and the loss curves
    agree."""
    env = dict(os.environ, HF_TPU_SIMULATE="1", MODEL="smoke", STEPS="4", CURVE_STEPS="4", CALLS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--out", str(tmp_path), "--stages", "denoiser:900",
                           "denoiser:900:SHAPE=flux", "train:900"], env=env, capture_output=True, text=True,
                          timeout=SAFETY_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    by_step = {}
    for r in records:
        by_step.setdefault((r["stage"], r["step"]), []).append(r)
    assert by_step[("denoiser", "pipeline_call")][0]["compiles"]["graphs"] == 0
    steps = by_step[("denoiser", "denoiser_step")]
    assert [r["batch"] for r in steps] == [2, 1, 1]  # SD3 with CFG and without, then Flux (guidance embedded)
    assert [r["pipeline"] for r in by_step[("denoiser", "pipeline")]] == ["StableDiffusion3Pipeline", "FluxPipeline"]
    assert all(r["compiles_after_warmup"] == {"graphs": 0, "tpu_cache_misses": 0} for r in steps)
    # the batch each pipeline called its denoiser with: the graph it compiled
    assert steps[0]["compiles_first_call"]["graphs"] == steps[2]["compiles_first_call"]["graphs"] == 0
    assert all(r["flops"]["total"] > 0 and r["fraction_of_matmul_rate"] > 0 for r in steps)
    assert all(r["compiles_after_warmup"]["graphs"] == 0 for r in by_step[("denoiser", "vae_decode")])
    tiny = {(r["pipeline"], r["precision"]): r["max_abs_err"]
            for r in by_step[("denoiser", "tiny_pipeline_vs_cpu")]}  # fmt: skip
    assert tiny[("StableDiffusion3Pipeline", "highest")] < 1e-4 and tiny[("FluxPipeline", "highest")] < 1e-4
    train = by_step[("train", "train")][0]
    assert train["compiles_after_step_2"] == {"graphs": 0, "tpu_cache_misses": 0} and len(train["steps"]) == 4
    assert train["tokens_per_s"] > 0 and train["flops"]["total"] > 0
    curve = by_step[("train", "loss_curve_vs_cpu")][0]
    assert len(curve["tpu"]) == len(curve["cpu"]) == 4 and curve["max_abs_diff"] < 1e-2
    assert curve["tpu"][0] == pytest.approx(curve["cpu"][0], abs=1e-5)


def test_install_takes_transformers_from_the_ex_folder_into_the_tt_call(tmp_path, monkeypatch):
    """transformers' wheel travels in ex (with torch_tpu and the working tree the tt call passed the tool's 64 MiB on
    2026-12-07): ex's call installs the other extras without their needs and keeps transformers' wheel among the
    wheels, and tt's call installs it from there with its needs from the index and those wheels."""
    import tarfile

    s = _script()
    calls = []
    monkeypatch.setattr(s, "CHIP_HOME", tmp_path / "home")
    monkeypatch.setattr(s, "_pip", lambda *args: calls.append(args))
    ex, tt = tmp_path / "ex", tmp_path / "tt"
    for folder, names in ((ex, ("transformers-5.25.0-py3-none-any.whl", "tokenizers-0.23.3-cp310-abi3-x.whl")),
                          (tt, ("pyzmq-27.3.0-cp311-x.whl",))):  # fmt: skip
        folder.mkdir()
        for name in names:
            (folder / name).write_bytes(b"wheel")
    (tmp_path / "torch_tpu").mkdir()
    (tmp_path / "torch_tpu" / "__init__.py").write_text("")
    with tarfile.open(tt / "torch_tpu.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "torch_tpu", arcname="torch_tpu")
    s.install(ex)
    assert len(calls) == 1 and not any("transformers-" in a for a in calls[0]), calls
    assert any(a.endswith("tokenizers-0.23.3-cp310-abi3-x.whl") for a in calls[0])
    assert (tmp_path / "home" / "wheels" / "transformers-5.25.0-py3-none-any.whl").exists()
    calls.clear()
    s.install(tt)
    installed = [c for c in calls if c[-1].endswith("transformers-5.25.0-py3-none-any.whl")]
    assert len(installed) == 1 and "--no-deps" not in installed[0], calls
    assert str(tmp_path / "home" / "wheels") in installed[0]  # its needs found among ex's wheels too
    assert (tmp_path / "home" / "site" / "torch_tpu" / "__init__.py").exists()
