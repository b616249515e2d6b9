"""A tensor-parallel plan for MiniMax-H3, so that diffusers' own ``TensorParallelConfig`` shards it.

diffusers 0.42's ``MiniMaxH3Transformer3DModel`` declares a context-parallel ``_cp_plan`` only; its ``_tp_plan`` is
``None``, and ``from_pretrained(..., parallel_config=TensorParallelConfig(tp_degree=4))`` refuses it ("`_tp_plan` must
be set on the model class"). Its blocks are of the kind diffusers shards for Flux and Qwen-Image: one packed
video + audio (+ text) sequence through shared blocks, each a self-attention with separate ``to_q``/``to_k``/``to_v``
and a SwiGLU feed-forward.

With the ``diffusers`` integration enabled (``hf_tpu.enable()``), two patches (through :mod:`hf_tpu._patch`, written
for diffusers ``>=0.42,<0.43``, reverted by ``hf_tpu.disable()``):

- ``MiniMaxH3Transformer3DModel._tp_plan`` is set to :func:`tp_plan`, in the style of diffusers' own plans: in the
  text refiner's and the joint blocks' attention ``to_q``/``to_k``/``to_v`` are ``"colwise"`` (whole heads per rank)
  and ``to_out.0`` is ``"rowwise"``; the feed-forward's ``net.0.proj`` packs SwiGLU's two halves in one Linear, so it
  is ``PackedColwiseParallel([1, 1])`` (each rank takes its slice of each half), and ``net.2`` is ``"rowwise"``. The
  input and output projections of both streams (``proj_in``/``audio_proj_in``/``proj_out``/``audio_proj_out``), the
  AdaLN modulation and the QK-norms stay replicated, as in diffusers' plans: the modulation indexes the whole hidden
  width and the QK-norm runs over one head's width. If diffusers declares its own plan, hf_tpu's stands aside.
- ``diffusers.hooks.tensor_parallel.apply_tensor_parallel`` (both ``from_pretrained`` and ``enable_parallelism`` call
  it; also its alias ``diffusers.hooks.apply_tensor_parallel``) then sets each sharded ``MiniMaxH3Attention``'s
  ``heads`` to the heads of its rank. Upstream's ``MiniMaxH3AttnProcessor`` reshapes by ``attn.heads``
  (``unflatten(-1, (attn.heads, -1))``), which on a rank's column slice would make ``tp_degree`` times too many, too
  narrow heads; Flux's processor reshapes by ``head_dim`` instead. Other models are left as upstream shards them.

Example:
    >>> import hf_tpu
    >>> from diffusers import MiniMaxH3Transformer3DModel, TensorParallelConfig
    >>> hf_tpu.enable()                                                  # doctest: +SKIP
    >>> transformer = MiniMaxH3Transformer3DModel.from_pretrained(       # doctest: +SKIP
    ...     path, parallel_config=TensorParallelConfig(tp_degree=4))
"""

from __future__ import annotations

import functools
from typing import Any

from hf_tpu._patch import original, patch

__all__ = ["apply", "tp_plan"]

FEATURE = "diffusers"
_WRITTEN_FOR = ">=0.42,<0.43"
_MODULE = "diffusers.models.transformers.transformer_minimax_h3"
_BLOCKS = ("token_refiner.refiner_blocks", "transformer_blocks")


def tp_plan() -> dict[str, Any]:
    """hf_tpu's ``_tp_plan`` for ``MiniMaxH3Transformer3DModel`` (a new dict on each call)."""
    from diffusers.hooks.tensor_parallel import PackedColwiseParallel

    plan: dict[str, Any] = {}
    for blocks in _BLOCKS:
        plan[f"{blocks}.*.attn.to_q"] = "colwise"
        plan[f"{blocks}.*.attn.to_k"] = "colwise"
        plan[f"{blocks}.*.attn.to_v"] = "colwise"
        plan[f"{blocks}.*.attn.to_out.0"] = "rowwise"
        # SwiGLU: one Linear makes [hidden, gate]; each rank needs its slice of both halves
        plan[f"{blocks}.*.ff.net.0.proj"] = PackedColwiseParallel([1, 1])
        plan[f"{blocks}.*.ff.net.2"] = "rowwise"
    return plan


def _localize_heads(model: Any, attention_cls: type, tp_degree: int) -> None:
    """Each sharded attention of ``model`` keeps ``heads // tp_degree`` heads: the ones in its rank's slice."""
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        if not isinstance(module, attention_cls) or getattr(module, "_hf_tpu_global_heads", None) is not None:
            continue
        if not isinstance(module.to_q.weight, DTensor):
            continue  # not in the plan (another plan than hf_tpu's): upstream's head count
        module._hf_tpu_global_heads = module.heads
        module.heads = module.heads // tp_degree


def _apply_tensor_parallel(upstream: Any, module: Any) -> Any:
    @functools.wraps(upstream)
    def apply_tensor_parallel(model: Any, config: Any, tp_plan: dict, *args: Any, **kwargs: Any) -> Any:
        result = upstream(model, config, tp_plan, *args, **kwargs)
        if isinstance(model, module.MiniMaxH3Transformer3DModel) and config._mesh is not None:
            _localize_heads(model, module.MiniMaxH3Attention, config._mesh.size())
        return result

    apply_tensor_parallel.__hf_tpu_minimax_h3__ = True  # type: ignore[attr-defined]
    return apply_tensor_parallel


def apply() -> None:
    """Give ``MiniMaxH3Transformer3DModel`` hf_tpu's tensor-parallel plan (idempotent; a diffusers without MiniMax-H3
    or with its own plan for it is left alone)."""
    try:
        module = __import__(_MODULE, fromlist=["MiniMaxH3Transformer3DModel"])
        from diffusers.hooks import tensor_parallel
    except ImportError:
        return
    cls = module.MiniMaxH3Transformer3DModel
    if not hasattr(module, "MiniMaxH3Attention") or not hasattr(tensor_parallel, "PackedColwiseParallel"):
        return  # another layout than the one this was written for
    if cls._tp_plan is not None and not getattr(cls, "_hf_tpu_tp_plan", False):
        return  # diffusers' own plan: it knows its processor
    if not getattr(cls, "_hf_tpu_tp_plan", False):
        patch(cls, "_tp_plan", tp_plan(), feature=FEATURE, package="diffusers", versions=_WRITTEN_FOR)
        patch(cls, "_hf_tpu_tp_plan", True, feature=FEATURE, package="diffusers", versions=_WRITTEN_FOR)
    if getattr(tensor_parallel.apply_tensor_parallel, "__hf_tpu_minimax_h3__", False):
        return  # already patched (idempotent)
    upstream = original(tensor_parallel, "apply_tensor_parallel")
    replacement = _apply_tensor_parallel(upstream, module)
    import diffusers.hooks

    # modeling_utils imports it from the module at each call; `diffusers.hooks` re-exports it
    for owner in (tensor_parallel, diffusers.hooks):
        if owner.__dict__.get("apply_tensor_parallel") is upstream:
            patch(
                owner, "apply_tensor_parallel", replacement,
                feature=FEATURE, package="diffusers", versions=_WRITTEN_FOR,
            )  # fmt: skip
