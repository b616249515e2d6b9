"""The lowering process's entry for a training step: a causal LM built from its config on the meta device (no
memory, nothing read), one step of forward with the loss, backward and AdamW traced to ATen graphs, and each graph
lowered by torch_tpu's real front end for deferred ``tpu`` inputs of the same shapes. Runs inside
:mod:`hf_tpu.tpu_compile._child` only.

Why traced on the meta device: autograd's engine cannot run on ``tpu`` tensors on a host without a chip (after every
backward it syncs the device's streams, which needs torch_tpu's PjRt client: the process dies with SIGSEGV in
``GraphTask::exec_post_processing``), and AOTAutograd's joint trace and ``torch.func.grad`` both go through it. On the
meta device they do not, so the step is traced there with ``make_fx`` (``torch.autograd.grad`` over
``torch.func.functional_call``: the backward is recorded into the graph, no engine runs later), the graph's device
arguments are moved from ``meta`` to ``tpu``, and the graph is handed to torch_tpu's ``"tpu"`` compile backend with
deferred ``tpu`` inputs, which lowers it as it would a graph Dynamo captured. Two programs result:

- ``train-forward-backward``: (parameters, token ids) -> (loss, gradients);
- ``optimizer-adamw``: (parameters, gradients, AdamW's two moments, step) -> (parameters, moments, step), AdamW
  with decoupled weight decay written out (``torch.optim.AdamW``'s update, ``foreach=False``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["lower_train", "trace_step"]

BETAS, EPS, LR, WEIGHT_DECAY = (0.9, 0.999), 1e-8, 1e-5, 0.01


def _adamw(params, grads, exp_avg, exp_avg_sq, step):
    """One AdamW step (torch.optim.AdamW's update, decoupled weight decay, bias-corrected), functional."""

    (b1, b2), t = BETAS, step + 1
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    new_p, new_m, new_v = [], [], []
    for p, g, m, v in zip(params, grads, exp_avg, exp_avg_sq):
        m = m * b1 + g * (1 - b1)
        v = v * b2 + g * g * (1 - b2)
        denom = (v / bc2).sqrt() + EPS
        new_p.append(p * (1 - LR * WEIGHT_DECAY) - (m / bc1) / denom * LR)
        new_m.append(m)
        new_v.append(v)
    return new_p, new_m, new_v, t


def trace_step(model, batch: int, seq_len: int, compute_dtype=None):
    """The ATen graphs of one training step of ``model`` (its parameters on the meta device for lowering; on the CPU
    the graphs also run, which is how the tests check them): forward with the loss and backward, then AdamW.
    Returns ``[(name, graph, example inputs), ...]``; the optimizer graph takes (parameters, gradients, exp_avg,
    exp_avg_sq, step) and returns (parameters, exp_avg, exp_avg_sq, step + 1)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p.detach() for n, p in model.named_parameters() if p.requires_grad]
    device = params[0].device
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)

    def loss_of(ps, ids):
        return torch.func.functional_call(model, dict(zip(names, ps)), (ids,), {"labels": ids}).loss

    n = len(params)

    def forward_backward(*flat):  # flat arguments and results: what a compile backend is handed by Dynamo
        ps = [p.detach().requires_grad_() for p in flat[:n]]
        # mixed precision as FSDP2's MixedPrecisionPolicy(param_dtype=...): the weights cast for the compute, the
        # gradients (through the cast) in the parameters' dtype
        cast = ps if compute_dtype is None else [p.to(compute_dtype) for p in ps]
        loss = loss_of(cast, flat[n])
        return (loss.detach(), *torch.autograd.grad(loss, ps))

    def adamw(*flat):
        p, g, m, v = (list(flat[i * n : (i + 1) * n]) for i in range(4))
        new_p, new_m, new_v, t = _adamw(p, g, m, v, flat[4 * n])
        return (*new_p, *new_m, *new_v, t)

    fwbw = make_fx(forward_backward)(*params, ids)
    # distinct tensors for each argument: make_fx gives one placeholder to a tensor passed twice
    grads, exp_avg, exp_avg_sq = ([torch.zeros_like(p) for p in params] for _ in range(3))
    step = torch.zeros((), dtype=torch.float32, device=device)
    opt_inputs = [*params, *grads, *exp_avg, *exp_avg_sq, step]
    opt = make_fx(adamw)(*opt_inputs)
    return [("train-forward-backward", fwbw, [*params, ids]), ("optimizer-adamw", opt, opt_inputs)]


def _to_tpu(graph) -> None:
    """Move the graph's device arguments (factory functions' ``device=meta``) and its constants to ``tpu``."""
    import torch

    tpu = torch.device("tpu", 0)

    def move(value):
        if isinstance(value, torch.device) and value.type == "meta":
            return tpu
        return value

    for node in graph.graph.nodes:
        node.args = tuple(move(a) for a in node.args)
        node.kwargs = {k: move(v) for k, v in node.kwargs.items()}
        if node.op == "get_attr":  # a buffer the trace kept as a constant (RoPE's inv_freq): deferred, on tpu
            value = getattr(graph, node.target)
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                setattr(graph, node.target, torch.empty(value.shape, dtype=value.dtype, device=tpu))
    graph.recompile()


def lower_train(
    session,
    model: str,
    dtype: str | None = "bfloat16",
    batch: int = 1,
    seq_len: int = 2048,
    layers: int | None = None,
    compute_dtype: str | None = None,
) -> dict[str, Any]:
    """Lower one training step of the model at ``model`` (a directory or a config.json) for ``batch`` sequences of
    ``seq_len`` tokens (``layers``: only the first that many decoder layers, the same width). Parameters, gradients
    and AdamW's two moments are in ``dtype``; with ``compute_dtype`` the forward and backward compute on the weights
    cast to it (FSDP2's mixed precision: fp32 shards, bf16 compute). Returns labels and facts for the plan."""
    import time

    import torch

    from hf_tpu._patch import enable
    from hf_tpu.tpu_compile._generate import weight_bytes

    built, torch_dtype = _build(model, dtype, layers)
    trainable = [p for p in built.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    info: dict[str, Any] = {
        "model_type": built.config.model_type,
        "parameters": sum(p.numel() for p in built.parameters()),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "batch": batch,
        "seq_len": seq_len,
        "params_bytes": weight_bytes(built),
        "grads_bytes": grad_bytes,
        "optimizer_bytes": 2 * grad_bytes,  # exp_avg and exp_avg_sq, each of the parameter's size and dtype
        "largest_layer_bytes": _largest_layer_bytes(built),
    }
    info["layers"] = built.config.get_text_config(decoder=True).num_hidden_layers
    started = time.perf_counter()
    graphs = trace_step(built, batch, seq_len, getattr(torch, compute_dtype) if compute_dtype else None)
    info["compute_dtype"] = compute_dtype or info["dtype"]
    info["trace_seconds"] = time.perf_counter() - started
    enable()
    backend = torch._dynamo.lookup_backend("tpu")
    for _name, graph, example in graphs:
        _to_tpu(graph)
        inputs = [torch.empty(t.shape, dtype=t.dtype, device="tpu") for t in example]
        session.mark()
        with session.mode:
            compiled = backend(graph, inputs)
            compiled(*inputs)
    info["labels"] = [name for name, _, _ in graphs]
    return info


def _build(model: str, dtype: str | None, layers: int | None):
    """The causal LM of ``model`` on the meta device in train mode; ``layers`` keeps the first that many decoder
    layers (and the config's per-layer lists cut to match)."""
    import os

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(os.path.dirname(model) if model.endswith(".json") else model)
    if layers:
        text = config.get_text_config(decoder=True)
        text.num_hidden_layers = layers
        for name in ("layer_types", "mlp_only_layers"):
            value = getattr(text, name, None)
            if isinstance(value, list) and len(value) > layers:
                setattr(text, name, value[:layers])
    torch_dtype = getattr(torch, dtype) if dtype else (getattr(config, "dtype", None) or torch.float32)
    if isinstance(torch_dtype, str):
        torch_dtype = getattr(torch, torch_dtype)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    return built.train(), torch_dtype


def _largest_layer_bytes(model) -> int:
    """Bytes of the largest unit FSDP all-gathers at once, wrapped as hf_tpu wraps it (a unit per decoder layer, the
    rest of the model, embeddings and head, as the root unit): the largest of a decoder layer and that rest."""
    import torch

    def size(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        return size(model.parameters())
    layers = [size(layer.parameters()) for layer in lists[0]]
    return max(max(layers), size(model.parameters()) - sum(layers))
