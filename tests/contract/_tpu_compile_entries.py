"""Entries the compile tier's lowering processes run (``hf_tpu.tpu_compile.lower_and_compile``): each builds a tiny
piece of hf_tpu's work on deferred tpu tensors and runs it, so that torch_tpu lowers the graphs it compiles."""

from __future__ import annotations

import torch

#: Distinct shapes per input, so that the lowered module's arguments map back to the inputs by shape.
BLOCK_SHAPES = {"x": (3, 5, 16), "w_qkv": (16, 48), "w_up": (16, 40), "w_down": (40, 16)}


def block(x, w_qkv, w_up, w_down):
    """An attention + MLP block written without sdpa (a program with no custom call, for XLA:CPU)."""
    q, k, v = (x @ w_qkv).chunk(3, dim=-1)
    scores = (q @ k.transpose(-1, -2)) / 4.0
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=x.device).tril()
    attn = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
    h = x + attn
    return h + torch.nn.functional.gelu(h @ w_up) @ w_down


def lower_block(session):
    inputs = [torch.empty(BLOCK_SHAPES[n], device="tpu") for n in BLOCK_SHAPES]
    compiled = torch.compile(block, backend="tpu", fullgraph=True, dynamic=False)
    with session.mode:
        compiled(*inputs)
    return {"labels": ["block"]}


def lower_train_forward(session, family: str = "llama"):
    """A training step's forward with its loss (train mode, labels), as hf_tpu's training path compiles it.

    Its backward cannot be lowered without a chip: autograd's engine syncs the device's streams after every
    backward (``GraphTask::exec_post_processing``), which needs torch_tpu's PjRt client; ``torch.func.grad`` inside
    the graph goes through the same engine while tracing. Reproducer: :func:`lower_train_backward`."""
    from transformers import AutoModelForCausalLM

    from hf_tpu.testing import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(family))
    model = model.to_empty(device="tpu").train()
    ids = torch.empty(2, 16, dtype=torch.long, device="tpu")

    def loss_fn(ids):
        return model(input_ids=ids, labels=ids).loss

    compiled = torch.compile(loss_fn, backend="tpu", fullgraph=True, dynamic=False)
    with session.mode, torch.no_grad():
        compiled(ids)
    return {"labels": ["train-forward"]}


def lower_train_backward(session):
    """The reproducer of the backward limit above: the lowering process dies in autograd's engine (SIGSEGV)."""
    w = torch.empty(8, 8, device="tpu", requires_grad=True)
    compiled = torch.compile(lambda w: (w * w).sum(), backend="tpu", fullgraph=True, dynamic=False)
    with session.mode:
        compiled(w).backward()
    return {"labels": ["forward", "backward"]}


def lower_moe_generate(session, model: str, experts_implementation: str | None = None):
    """generate's warm-up for a tiny MoE with the given experts implementation."""
    from hf_tpu.tpu_compile import _generate

    if experts_implementation == "ragged_dot_tpu":  # hf_tpu's Hub kernel (its Pallas path on a tpu device)
        import hf_tpu.kernels

        experts_implementation = hf_tpu.kernels.use_ragged_dot_experts()
    return _generate.lower_generate(session, model, max_prompt_len=16, max_new_tokens=8, dtype="float32",
                                    experts_implementation=experts_implementation)  # fmt: skip


def lower_with_env(session, env: dict[str, str], entry: str, kwargs: dict):
    """``entry`` (``"module:function"``) run with ``env`` set in this process's environment, restored after: a
    setting hf_tpu reads when it runs (``HF_TPU_KV_WRITE``) for one entry of a shared lowering process."""
    import importlib
    import os

    module_name, func_name = entry.split(":")
    function = getattr(importlib.import_module(module_name), func_name)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return function(session, **kwargs)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def routing_offsets(counts, scale, mask):
    """The MoE routing's offsets (transformers' grouped_mm path: cumsum of tokens per expert), a use of them, and
    positions from an attention mask along its last dimension (BLOOM's ALiBi)."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    positions = (mask.long().cumsum(dim=-1) - 1) * mask.long()
    return offsets, offsets.float() * scale, positions


def lower_routing_offsets(session):
    counts = torch.empty(8, dtype=torch.int32, device="tpu")
    scale = torch.empty(3, 1, device="tpu")
    mask = torch.empty(2, 6, dtype=torch.bool, device="tpu")
    compiled = torch.compile(routing_offsets, backend="tpu", fullgraph=True, dynamic=False)
    with session.mode:
        compiled(counts, scale, mask)
    return {"labels": ["routing-offsets"]}


def lower_sd3_denoiser(session, size: int = 32):
    """One denoising step of a tiny SD3 transformer, compiled as ``hf_tpu.diffusers.compile_pipeline`` compiles the
    denoiser (``module.compile(backend="tpu", fullgraph=True, dynamic=False)``), at one resolution."""
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        model = SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
            caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
        )  # fmt: skip
    model = model.to_empty(device="tpu").eval()
    model.compile(backend="tpu", fullgraph=True, dynamic=False)
    latents = torch.empty(2, 4, size // 2, size // 2, device="tpu")  # classifier-free guidance: batch 2
    text = torch.empty(2, 77 + 16, 32, device="tpu")
    pooled = torch.empty(2, 64, device="tpu")
    timestep = torch.empty(2, device="tpu")
    with session.mode, torch.no_grad():
        model(hidden_states=latents, encoder_hidden_states=text, pooled_projections=pooled, timestep=timestep)
    return {"labels": [f"denoiser-{size}x{size}"]}


def lower_tp_rank_layer(session, world_size: int = 2):
    """Rank 0's part of a tensor-parallel MLP layer (column-parallel up, row-parallel down, all-reduce, norm) over a
    process group of ``world_size`` ranks that exchanges nothing (torch's fake process group, registered for the tpu
    device): what a TP=2 rank compiles. torch_tpu's split compiler cuts the graph at the collective, which runs
    between the compiled programs; each program lowers and compiles."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore, _create_fake_pg

    dist.Backend.register_backend("fake_tpu", _create_fake_pg, extended_api=True, devices=["tpu"])
    dist.init_process_group(backend="tpu:fake_tpu,cpu:fake", store=FakeStore(), rank=0, world_size=world_size)
    group = dist.group.WORLD
    hidden, inner = 64, 128 // world_size
    x = torch.empty(4, hidden, device="tpu")
    w_up, w_down = torch.empty(hidden, inner, device="tpu"), torch.empty(inner, hidden, device="tpu")

    def layer(x, w_up, w_down):
        partial = torch.nn.functional.silu(x @ w_up) @ w_down
        return torch.nn.functional.layer_norm(x + funcol.all_reduce(partial, "sum", group), (hidden,))

    compiled = torch.compile(layer, backend="tpu", fullgraph=True, dynamic=False)
    with session.mode:
        compiled(x, w_up, w_down)
    dist.destroy_process_group()
    return {"labels": ["tp-rank-before-all-reduce", "tp-rank-collective", "tp-rank-after-all-reduce"]}


def lower_encoder_warmup(session, family: str = "bert", head: str = "AutoModel"):
    """hf_tpu's encoder warm-up (hf_tpu.encoders) for a tiny encoder on deferred tpu weights: its (batch, length)
    bucket graphs go through torch_tpu's lowering."""
    import transformers

    import hf_tpu
    from hf_tpu.encoders import compiled_graphs, warmup
    from hf_tpu.testing import ENCODER_FAMILIES

    config_class, defaults = ENCODER_FAMILIES[family]
    config = getattr(transformers, config_class)(**defaults)
    with torch.device("meta"):
        model = getattr(transformers, head).from_config(config)
    model = model.to_empty(device="tpu").eval()
    hf_tpu.enable("encoders")
    with session.mode:
        warmup(model, max_length=32, batch_sizes=[2], progress=False)
    return {"labels": [f"encoder-{b}x{n}" for b, n, *_ in compiled_graphs(model)]}


def _masked_double(x):
    return x[x > 0] * 2  # (a boolean-mask index: its shape is a count of the mask's values)


def _item_scaled(x):
    return x * (x > 0).sum().item()  # (a read of a device value on the host)


def _rows_put(x, mask, rows):
    y = x.clone()
    y[mask] = rows  # (a row per masked position: as many as the mask's True values)
    return y


def _masked_fill_by_index(x, mask, row):
    y = x.clone()
    y[mask] = 0  # (one value for every masked position: a select, whatever the count)
    y[mask.all(dim=-1)] = row  # (a row broadcast to every masked row)
    return y


def lower_host_reads(session):
    """Graphs reading a device value on the host, and assignments through a boolean mask, as torch_tpu lowers them:
    for each, the refusal's text (an exception out of ``torch.compile``; None when it lowered) and the reason hf_tpu's
    loops read from it (``_graphs._not_one_graph``, with which they take the next route). Only the masked fill lowers
    (its program is labelled ``masked-fill``)."""
    from hf_tpu.transformers._graphs import _not_one_graph

    x = torch.empty(2, 6, device="tpu")
    mask, rows_mask = torch.empty(2, 6, dtype=torch.bool, device="tpu"), torch.empty(4, dtype=torch.bool, device="tpu")
    rows, row = torch.empty(3, 6, device="tpu"), torch.empty(6, device="tpu")  # (3 of 4 rows masked, say)
    cases = (
        ("mask", _masked_double, (x,)), ("item", _item_scaled, (x,)),
        ("rows", _rows_put, (torch.empty(4, 6, device="tpu"), rows_mask, rows)),
        ("fill", _masked_fill_by_index, (x, mask, row)),
    )  # fmt: skip
    found = {}
    labels = []
    for name, fn, args in cases:
        compiled = torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False)
        try:
            before = len(session.programs)
            with session.mode:
                compiled(*args)
            labels += ["masked-fill"] * (len(session.programs) - before)
            found[name] = {"error": None, "reason": None}
        except Exception as exc:  # noqa: BLE001 - the refusal is what this entry reports
            found[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000], "reason": _not_one_graph(exc)}
    return {"labels": labels, "refusals": found}


def lower_vision_warmup(session, family: str, image_size: tuple[int, int] = (16, 16), prompt_bucket: int = 16,
                        max_new_tokens: int = 8):  # fmt: skip
    """Warm-up's image graphs (``hf_tpu.warmup(image_sizes=[image_size])``'s part for images:
    :func:`hf_tpu.transformers._mm_warmup.warm_images`, one image per prompt, batch 1) of a tiny vision-language model
    (the ``family`` builder of tests/transformers/test_vision_generate.py) on deferred tpu weights: its vision tower's
    graph (``"vision"``, Qwen2-VL's grid-keyed ``"grid_vision"``), the image prefill (``"mm_prefill"``) and the
    decode (``"+mrope"`` for Qwen2-VL's three rows of positions) go through torch_tpu's lowering. Each program is
    labelled with the kind of the graph key that lowered it (``grid_vision``, ``mm_prefill+mrope``); a key whose
    graph dynamo reused (Gemma 3's image decode is the text decode's graph) lowers nothing."""
    import sys
    from pathlib import Path

    from hf_tpu._patch import enable
    from hf_tpu.transformers import _graphs, _mm_warmup
    from hf_tpu.transformers._loops.defaults import own_variant

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transformers"))
    import test_vision_generate as vlm

    cls, config, _ = getattr(vlm, f"_{family}")()  # (the builders of _BUILDERS, and Qwen3-VL's)
    with torch.device("meta"):
        model = cls(config)
    enable()
    model = model.to_empty(device="tpu").eval()
    labels: list[str] = []
    run_graph = _graphs.run_graph

    def recording(model, state, key, *args):  # (each program lowered while the graph of ``key`` ran)
        first = len(session.programs)
        try:
            return run_graph(model, state, key, *args)
        finally:
            labels.extend([str(key[0])] * (len(session.programs) - first))  # (a GraphKind: its text)

    _mm_warmup.run_graph = recording  # (the image graphs' runner, as warm_images calls it)
    try:
        with session.mode, torch.no_grad():
            keys = _mm_warmup.warm_images(model, 1, tuple(image_size), 1, [prompt_bucket], max_new_tokens,
                                          own_variant(model))  # fmt: skip
    finally:
        _mm_warmup.run_graph = run_graph
    return {"labels": labels, "graph_keys": [[str(k) for k in key] for key in keys]}


#: A tiny SD3-shaped AutoencoderKL (stabilityai/stable-diffusion-3.5-medium vae/config.json's kinds of block, 16 latent
#: channels, no quant convs; two blocks of 32 and 64 channels): its decoder's mid-block has the attention whose
#: residual is channels-last.
TINY_SD3_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[32, 64], layers_per_block=1,
                    down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                    norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=1.5305,
                    shift_factor=0.0609, sample_size=32)  # fmt: skip


def lower_vae_decoder(session, latent: int = 16, dtype: str = "bfloat16", fixed: bool = True):
    """The VAE decode of one ``latent`` x ``latent`` latent of :data:`TINY_SD3_VAE`, its decoder compiled as
    ``compile_pipeline(pipe, vae=True)`` compiles it (``module.compile(backend="tpu", fullgraph=True,
    dynamic=False)``).
    ``fixed``: with hf_tpu's GroupNorm decomposition in torch_tpu's table (:mod:`hf_tpu._group_norm`, which
    ``compile_pipeline`` and the diffusers integration add), reverted after; else torch_tpu as it is. Returns the
    table's entries while it lowered."""
    from diffusers import AutoencoderKL

    from hf_tpu import _group_norm, _patch

    with torch.device("meta"):
        vae = AutoencoderKL(**TINY_SD3_VAE).to(getattr(torch, dtype))
    vae = vae.to_empty(device="tpu").eval()
    vae.decoder.compile(backend="tpu", fullgraph=True, dynamic=False)
    z = torch.empty(1, 16, latent, latent, dtype=getattr(torch, dtype), device="tpu")
    if fixed:
        _group_norm.apply("contract_vae")
    try:
        from torch_tpu._internal.compile import _backend

        table = sorted(str(op) for op in _backend._TPU_DECOMPOSITIONS)
        with session.mode, torch.no_grad():
            vae.decode(z)
    finally:
        _patch.revert("contract_vae")
    return {"labels": [f"vae-decoder-{latent}x{latent}"], "table": table}


#: The parameter groups of :func:`lower_optimizer`: (dtype, weight decay, amsgrad, shapes). The bfloat16 group has two
#: tensors of one shape (one bucket of two, one graph); its other shapes, and the other groups', are distinct.
OPTIMIZER_GROUPS = (
    ("bfloat16", 0.01, False, ((24, 16), (16, 40), (40,), (24, 16))),
    ("float32", 0.0, False, ((6, 10), (10,))),
    ("float32", 0.1, True, ((3, 5, 7),)),
)
OPTIMIZER_LR = (5e-2, 1e-3, 5e-4)  # (the bfloat16 group's large enough to move its parameters past rounding)


def llama_shapes(layers: int, hidden: int = 2048, inner: int = 8192, kv: int = 512, vocab: int = 128256):
    """The parameter shapes of a Llama-3.2-1B-shaped model (tied embeddings) with ``layers`` decoder layers, split
    as the Trainer groups them: (decayed: the matrices, not decayed: the norms)."""
    per_layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inner, hidden), (inner, hidden),
                 (hidden, inner)]  # fmt: skip
    return [(vocab, hidden)] + per_layer * layers, [(hidden,)] * (2 * layers + 1)


def _tpu_params(shapes, dtype):
    params = [torch.nn.Parameter(torch.empty(s, dtype=dtype, device="tpu")) for s in shapes]
    for p in params:
        p.grad = torch.empty_like(p)
    return params


class _Holder(torch.nn.Module):
    """The optimizer's parameters as a module's, with a forward that reads each (compiled as the Trainer's model)."""

    def __init__(self, params):
        super().__init__()
        for i, p in enumerate(params):
            self.register_parameter(f"p{i}", p)

    def forward(self, x):
        return x + sum(p.float().sum() for p in self.parameters())


def lower_optimizer(session, groups=None, lrs=None, steps: int = 3, clip: bool = True, forward: bool = True):
    """hf_tpu.training's compiled AdamW step (``hf_tpu.training.optim._adamw``, one graph per bucket of parameters:
    one group, one shape and dtype) and, with ``clip``, its compiled gradient clipping (``_norm`` over every gradient,
    then ``_scale`` per bucket of gradients), on deferred ``tpu`` parameters: ``steps`` optimizer steps (the first
    creates the state, eagerly, and compiles the graphs; each later one runs them), then two clips. With ``forward``,
    a module holding the parameters, compiled as the Trainer's model is, runs once before the steps and once after
    each step and clip (the rebound ``param.data`` must not recompile it).

    Returns, per warm step and warm clip, the eager traffic torch_tpu's runtime met around the compiled calls and the
    ops it was (``warm_eager``); per graph, in the order they compiled, its inputs as Dynamo ordered them (``sources``:
    ``L['params'][i]``, ``L['lr']``, ...), the lowered module's arguments as indices into them (``module_order``:
    torch_tpu's front end orders the arguments by first use, not as Dynamo does) and the tensors of the call that
    compiled it (``calls``: ``[group, index in the group]`` per bucket entry; the clipping's indices count over every
    parameter, group 0)."""
    import collections

    from hf_tpu.training import AdamW, clip_grad_norm_, optim

    groups = groups or [list(g) for g in OPTIMIZER_GROUPS]
    lrs = lrs or OPTIMIZER_LR
    param_groups = [
        {"params": _tpu_params([tuple(s) for s in shapes], getattr(torch, dtype)), "weight_decay": wd,
         "amsgrad": amsgrad, "lr": lr}
        for (dtype, wd, amsgrad, shapes), lr in zip(groups, lrs)
    ]  # fmt: skip
    params = [p for g in param_groups for p in g["params"]]
    where = {id(p): [g, i] for g, group in enumerate(param_groups) for i, p in enumerate(group["params"])}
    sources: list[list[str]] = []
    backend = torch._dynamo.lookup_backend("tpu")

    def recording(gm, example_inputs, **kwargs):
        sources.append([str(n.meta["grapharg"].source.name) for n in gm.graph.nodes if n.op == "placeholder"])
        return backend(gm, example_inputs, **kwargs)

    from torch_tpu._internal import export as _export

    fx_to_mlir = _export.fx_to_mlir
    order: list[list[int]] = []

    def recording_fx(module, *args, **kwargs):  # (AOTAutograd names its K-th input ``argK_1``)
        order.append([int(n.name[3:].split("_")[0]) for n in module.graph.nodes if n.op == "placeholder"])
        return fx_to_mlir(module, *args, **kwargs)

    labels: list[str] = []
    calls: list[list[list[int]]] = []

    def labelled(name, fn, key):
        compiled = torch.compile(fn, backend=recording, fullgraph=True, dynamic=False)

        def run(tensors, *args):
            first = len(session.programs)
            out = compiled(tensors, *args)
            new = len(session.programs) - first
            labels.extend([name] * new)
            calls.extend([key(tensors)] * new)
            return out

        return run

    grads_of = {}  # (the clipping's gradients: id -> index over every parameter)
    _export.fx_to_mlir = recording_fx
    saved = dict(optim._COMPILED)
    optim._COMPILED.clear()
    optim._COMPILED["adamw"] = labelled("adamw", optim._adamw, lambda ps: [where[id(p)] for p in ps])
    optim._COMPILED["norm"] = labelled("norm", optim._norm, lambda gs: [[0, grads_of[id(g)]] for g in gs])
    optim._COMPILED["scale"] = labelled("scale", optim._scale, lambda gs: [[0, grads_of[id(g)]] for g in gs])
    holder = _Holder(params)
    holder.compile(backend=recording, fullgraph=True, dynamic=False)
    x = torch.empty((), device="tpu")
    mode_class = type(session.mode)
    dispatch = mode_class.__torch_dispatch__
    seen: list[str] = []
    warm = []

    def counting(self, func, types, args=(), kwargs=None):
        seen.append(str(func))
        return dispatch(self, func, types, args, kwargs)

    def counted(fn, record: bool) -> None:
        before = dict(session.counts)
        del seen[:]
        mode_class.__torch_dispatch__ = counting
        try:
            fn()
        finally:
            mode_class.__torch_dispatch__ = dispatch
        if record:
            warm.append({k: v - before.get(k, 0) for k, v in session.counts.items()})
            warm[-1]["ops"] = dict(collections.Counter(seen))

    def run_forward() -> None:
        if forward:
            first = len(session.programs)
            with torch.no_grad():  # (a backward cannot be lowered without a chip: lower_train_forward)
                holder(x)
            labels.extend(["forward"] * (len(session.programs) - first))
            calls.extend([[]] * (len(session.programs) - first))

    try:
        opt = AdamW(param_groups, lr=lrs[0], betas=(0.9, 0.95), eps=1e-6)
        with session.mode:
            run_forward()
            for i in range(steps):
                counted(opt.step, record=i > 0)
                run_forward()
            if clip:
                for i in range(2):
                    grads_of.clear()
                    grads_of.update({id(p.grad): k for k, p in enumerate(params)})
                    counted(lambda: clip_grad_norm_(params, 1.0), record=i > 0)
                    run_forward()
            state = opt.state[params[0]]
            kept = {"param": str(params[0].dtype), **{k: str(v.dtype) for k, v in state.items()}}
    finally:
        _export.fx_to_mlir = fx_to_mlir
        optim._COMPILED.clear()
        optim._COMPILED.update(saved)
    return {"labels": labels, "warm_eager": warm, "sources": sources, "tensors": len(params), "module_order": order,
            "calls": calls, "dtypes": kept}  # fmt: skip


def lower_llama_optimizer(session, layers: int = 2):
    """:func:`lower_optimizer` for a Llama-3.2-1B-shaped parameter list (``layers`` decoder layers) in bfloat16, in
    the Trainer's two groups (weight decay 0.01 on the matrices, none on the norms), and its clipping."""
    decayed, plain = llama_shapes(layers)
    groups = [["bfloat16", 0.01, False, decayed], ["bfloat16", 0.0, False, plain]]
    return lower_optimizer(session, groups, (1e-4, 1e-4), steps=2, clip=True, forward=False)


#: The continuous-batching ladder of :func:`lower_serving_step` (tests/serving/conftest.py's: one query rung of 32
#: tokens, KV rungs 0/64/1024, 4 slots, pages of 64 tokens).
SERVING_SETTINGS = {"max_batch_tokens": 32, "q_min": 32, "slots": 4, "page_size": 64, "kv_factor": 16}


def lower_serving_step(session, shapes=((32, 0), (32, 64)), vocab_size: int = 96, num_blocks: int = 16,
                       attn_implementation: str | None = None):
    """The continuous-batching step graph of a tiny Llama as a ``tpu`` manager builds it (hf_tpu's patches: the step
    inputs staged in one flat int32 tensor, the mask, int64 indices and the previous-tokens flag made in the graph,
    per-row sampling), run once per ``(query tokens, KV tokens read)`` shape by upstream's own
    ``ModelRunner.run_one_warmup`` on deferred tpu weights and cache. ``(q, 0)`` is a first prefill (no cache read),
    ``(q, kv)`` a step that reads ``kv`` cached tokens (decodes, chunked prefills). Each program is labelled
    ``step-{q}x{kv}``; upstream's warm-up logs a failure instead of raising, which is raised here. Returns, per
    program, its inputs as Dynamo named them (``sources``), the lowered module's arguments as AOTAutograd's input
    indices (``module_order``; the cache's per-layer views, which the step writes, are one synthetic base there, so
    these are not Dynamo's indices), and per shape the eager traffic of a second, warm step
    (``warm_eager``: the stand-in's counts; a warm-up step, not a steady one: its fake requests' cache pages and
    table rows are eager work too)."""
    import logging

    import transformers

    import hf_tpu
    from hf_tpu import serving
    from hf_tpu.testing import tiny_config

    failures: list[str] = []

    class _Failures(logging.Filter):
        def filter(self, record):
            if record.getMessage().startswith("Failed to warm up"):
                failures.append(record.getMessage())
            return True

    hf_tpu.enable()
    serving.configure(**SERVING_SETTINGS, compile_cache=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=vocab_size),
                                                              attn_implementation=attn_implementation)  # fmt: skip
    model = model.to_empty(device="tpu").eval()
    config = transformers.GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    labels: list[str] = []
    watcher = _Failures()
    logger = logging.getLogger("ContinuousBatchingLogger")  # transformers' continuous_batching/utils.py
    logger.addFilter(watcher)
    # transformers asks ``torch.get_device_module()`` (the current accelerator) whether to make streams and graphs:
    # torch_tpu answers that from its PjRt client, which a chipless host has not; the stand-in answers ``tpu`` (as on
    # a TPU VM), and ``torch.accelerator.is_available()`` answers False here, so no stream is made (none is part of
    # a graph)
    get_accelerator = torch._C._get_accelerator
    torch._C._get_accelerator = lambda: torch.device("tpu")
    from torch._dynamo.backends import registry
    from torch_tpu._internal import export as _export

    backend, fx_to_mlir = registry._COMPILER_FNS["tpu"], _export.fx_to_mlir
    sources: list[list[str]] = []
    order: list[list[int]] = []

    def recording(gm, example_inputs, **kwargs):  # (the "tpu" backend upstream's torch.compile looks up)
        sources.append([str(n.meta["grapharg"].source.name) for n in gm.graph.nodes if n.op == "placeholder"])
        return backend(gm, example_inputs, **kwargs)

    def recording_fx(module, *args, **kwargs):  # (AOTAutograd names its K-th input ``argK_1``)
        order.append([int(n.name[3:].split("_")[0]) for n in module.graph.nodes if n.op == "placeholder"])
        return fx_to_mlir(module, *args, **kwargs)

    registry._COMPILER_FNS["tpu"], _export.fx_to_mlir = recording, recording_fx
    warm: list[dict] = []
    try:
        with session.mode, torch.no_grad():
            # (the cache's size given: hf_tpu's sizing asks the chip for its memory)
            cb = transformers.ContinuousBatchingConfig(num_blocks=num_blocks)
            manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
            runner = manager._create_batch_processor().model_runner
            for q, kv in shapes:
                first = len(session.programs)
                runner.run_one_warmup(model=model, num_q_tokens=q, max_kv_read=kv)
                if failures:
                    raise RuntimeError(failures[-1])
                labels += [f"step-{q}x{kv}"] * (len(session.programs) - first)
                before = dict(session.counts)  # the same shape again: the compiled step and the traffic around it
                runner.run_one_warmup(model=model, num_q_tokens=q, max_kv_read=kv)
                warm.append({k: v - before.get(k, 0) for k, v in session.counts.items()})
    finally:
        logger.removeFilter(watcher)
        torch._C._get_accelerator = get_accelerator
        registry._COMPILER_FNS["tpu"], _export.fx_to_mlir = backend, fx_to_mlir
    staging = runner.inputs_and_outputs._hf_tpu_staging
    return {"labels": labels, "staged": staging is not None, "flat": list(staging.device.shape),
            "mask_types": staging.mask_types, "sources": sources, "module_order": order,
            "warm_eager": warm}  # fmt: skip
