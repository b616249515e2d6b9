"""One-token attention on a ``tpu`` device as two grouped matrix products, not torch_tpu's flash kernel.

transformers' ``sdpa`` attention calls ``scaled_dot_product_attention``, which torch_tpu 0.2.0 answers with its
flash-attention kernel (``aten::_scaled_dot_product_cudnn_attention``, a Mosaic call). Read from the decode program
hf_tpu lowers for a Llama-3.2-1B shape at batch 64 (32 query heads, 8 KV heads, a 640-slot cache): the kernel's
grid is (batch, query heads) = 64 x 32 steps per layer, each step pads its one query row to 128 and loads its KV
head's whole cache (768 slots: the cache is padded from 640 by a copy in every layer), so every KV head is read four
times and the cache is copied once more per step. On a v5e chip that program ran 39.5 ms where a lean JAX step of
the same model (the same attention as einsums over the KV heads) runs 9.1 ms (docs/planning.md, "Measured on a
chip").

For a query of one token (a decode step) the replacement groups the query heads by their KV head, computes
``q @ k^T`` per KV head (the cache read once), the softmax in float32 and ``p @ v``: XLA fuses these over the batch
and KV heads with no padding and no grid. Everything else (prefill, masks per head, position biases, dropout,
softcapping, attention sinks, a paged cache handed to the call (transformers 5.23 updates it there), tensors on
other devices) goes to upstream's ``sdpa_attention_forward`` unchanged.

``HF_TPU_DECODE_ATTENTION`` picks the form: ``grouped`` (the default), ``sdpa`` (upstream's call, torch_tpu's flash
kernel with ``enable_gqa``), ``packed`` (upstream's own one-token trick, ``pack_gqa``: the query heads of one KV head
as the kernel's rows, which upstream skips while Dynamo compiles) or ``ragged_kernel`` (the Hub kernel shipped in
``hf_tpu/kernels/hub/decode-attention-tpu``, loaded through ``kernels``: a Pallas kernel that reads only the blocks
between each row's first and last attended cache slot on torch_tpu's device, its torch reference on the simulator;
chosen only by the variable, it is not measured on a chip; a call with an additive mask takes ``grouped``). The chip
benchmark lowers the first three forms (scripts/chip_bench.py); docs/planning.md has the figures. The choice is
:data:`KERNEL_FORM`, registered with hf_tpu's kernel forms (:mod:`hf_tpu.kernels.forms`).
"""

from __future__ import annotations

import functools

import torch

from hf_tpu import _env
from hf_tpu.errors import SetupError
from hf_tpu.kernels.forms import KernelForm, choose_form, kernel_form

__all__ = [
    "FORMS",
    "KERNEL_FORM",
    "apply",
    "decode_attention_form",
    "grouped_decode_attention",
    "load_ragged_kernel",
    "ragged_kernel_decode_attention",
]

FORMS = _env.DECODE_ATTENTION.choices
ENV = _env.DECODE_ATTENTION.name

#: The one-token attention's kernel form: the variable's choice, no measured table (each form is lowered and timed by
#: scripts/chip_bench.py; the default is the one measured fastest, docs/planning.md).
KERNEL_FORM = KernelForm(
    "decode_attention", FORMS, "the one-token attention on a tpu device", override=_env.DECODE_ATTENTION,
    unmeasured="one form for every shape, set by HF_TPU_DECODE_ATTENTION; scripts/chip_bench.py times grouped, "
    "sdpa and packed; ragged_kernel (the decode-attention-tpu Hub kernel) is not measured on a chip and is taken "
    "only when the variable names it",
)  # fmt: skip


def decode_attention_form() -> str:
    """The one-token attention form in force (``HF_TPU_DECODE_ATTENTION``, ``grouped`` when unset)."""
    return choose_form("decode_attention")


def grouped_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of a one-token query over a cache, query heads grouped by their KV head.

    Args:
        query: ``(batch, heads, 1, head_dim)``.
        key, value: ``(batch, kv_heads, slots, head_dim)`` (``value``'s last dim may differ), ``heads`` a multiple of
            ``kv_heads``.
        attention_mask: None, or ``(batch or 1, 1, 1, slots)``: boolean (True attends) or additive.
        scaling: the scores' factor (``head_dim ** -0.5`` when None).

    Returns:
        ``(batch, heads, 1, value's head_dim)`` in the query's dtype, as sdpa returns it.
    """
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # the query heads of KV head j are rows of group j
    # Flash attention's order of arithmetic (and the CPU's sdpa kernel's, the simulator's reference): the scores summed
    # in float32 from the operands as they are (bf16 products summed in float32, as the MXU does), the softmax's
    # numerator exp(s - max) rounded to the value dtype for the second product, summed in float32, the normalisation
    # last. The numerator is taken as p / max(p) (max(p) = 1 / the softmax's sum): torch's softmax sums a row alike
    # wherever the bucket's padding sits, so a step's output does not depend on the left padding (a sum of its own
    # did: tests/transformers/test_cache_in_and_out.py). Normalising first, the product rounded to bf16, parted from
    # the CPU's greedy tokens by two bf16 steps of a logit (tests/quantization).
    scores = torch.matmul(q.float(), key.float().transpose(-1, -2)) * scale  # (batch, kv_heads, group, slots)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask.float()
    probs = torch.softmax(scores, dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    out = torch.matmul((probs / top).to(value.dtype).float(), value.float()) * top  # (batch, kv_heads, group, v dim)
    out = out.to(query.dtype)
    return out.reshape(batch, heads, 1, value.shape[-1])


_KERNEL: list = []


def _ragged_kernel():
    """The shipped decode-attention-tpu kernel module, loaded through ``kernels`` once per process: by :func:`apply`
    when the variable names ``ragged_kernel`` then, else by the first eager call. Loading reads files, which a
    Dynamo trace cannot hold: a trace that needs the kernel before it is loaded raises."""
    if not _KERNEL:
        if torch.compiler.is_compiling():
            raise SetupError(
                f"{ENV}=ragged_kernel was set after hf_tpu.enable('generation') and a compiled graph needs the "
                "decode-attention-tpu kernel, which loads from files (outside a graph): set the variable before "
                "hf_tpu.enable(), or call hf_tpu.transformers._decode_attention.load_ragged_kernel() first."
            )
        from hf_tpu.kernels.loader import load_decode_attention_kernel

        _KERNEL.append(load_decode_attention_kernel())
    return _KERNEL[0]


def load_ragged_kernel():
    """Load the decode-attention-tpu kernel the ``ragged_kernel`` form runs (once per process), outside any trace.

    :func:`apply` does it when ``HF_TPU_DECODE_ATTENTION`` names the form at ``hf_tpu.enable()``; call it before
    the first compiled decode step when the variable is set later.

    Returns:
        The kernel module.
    """
    return _ragged_kernel()


def _takes_ragged_kernel(key: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether the kernel computes this call: no mask, or a boolean one over the key's slots (an additive mask may
    carry biases the kernel's attended-or-not mask would drop)."""
    if attention_mask is None:
        return True
    return attention_mask.dtype == torch.bool and attention_mask.shape[-1] == key.shape[2]


def ragged_kernel_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """The decode-attention-tpu kernel's attention (its Pallas kernel on torch_tpu's device, its torch reference
    elsewhere), with :func:`grouped_decode_attention`'s arguments.

    Args:
        query: ``(batch, heads, 1, head_dim)``.
        key, value: ``(batch, kv_heads, slots, head_dim)``, ``heads`` a multiple of ``kv_heads``.
        attention_mask: None (every slot attended), or boolean ``(batch or 1, 1, 1, slots)``, True attends.
        scaling: the scores' factor (``head_dim ** -0.5`` when None).

    Returns:
        ``(batch, heads, 1, value's head_dim)`` in the query's dtype.
    """
    batch, slots = query.shape[0], key.shape[2]
    if attention_mask is None:
        valid = torch.full((batch,), slots, dtype=torch.int32, device=key.device)
    else:
        valid = attention_mask[:, 0, 0, :]
    return _ragged_kernel().decode_attention(query, key, value, valid, scaling)


def _takes_grouped(module, query, key, value, attention_mask, dropout, kwargs) -> bool:
    if query.device.type != "tpu" or query.dim() != 4 or query.shape[2] != 1 or key.shape[2] < 1:
        return False
    if dropout or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return False
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None or kwargs.get("output_attentions"):
        return False
    if kwargs.get("cache") is not None:  # transformers 5.23 updates a paged cache inside its sdpa call
        return False
    if key.dim() != 4 or value.dim() != 4 or query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1]:
        return False
    return attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)


def apply(feature: str) -> None:
    from transformers.modeling_utils import AttentionInterface

    from hf_tpu._patch import _check_version, on_revert

    upstream = AttentionInterface._global_mapping.get("sdpa")
    if upstream is None:  # pragma: no cover - every supported transformers has sdpa
        return
    upstream = getattr(upstream, "__hf_tpu_upstream__", upstream)
    _check_version(feature, "transformers", ">=5.23,<6")
    kernel_form("decode_attention")  # (the registry read here, outside any trace: the first read imports the forms)
    if decode_attention_form() == "ragged_kernel":
        _ragged_kernel()  # loaded here, outside any trace

    @functools.wraps(upstream)
    def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               is_causal=None, **kwargs):  # fmt: skip
        if _takes_grouped(module, query, key, value, attention_mask, dropout, kwargs):
            form = decode_attention_form()
            if form == "grouped":
                out = grouped_decode_attention(query, key, value, attention_mask, scaling)
                return out.transpose(1, 2).contiguous(), None
            if form == "packed":
                return _packed(upstream, module, query, key, value, attention_mask, scaling, kwargs)
            if form == "ragged_kernel":
                if _takes_ragged_kernel(key, attention_mask):
                    out = ragged_kernel_decode_attention(query, key, value, attention_mask, scaling)
                else:
                    out = grouped_decode_attention(query, key, value, attention_mask, scaling)
                return out.transpose(1, 2).contiguous(), None
        return upstream(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)  # fmt: skip

    sdpa_attention_forward.__hf_tpu_upstream__ = upstream
    AttentionInterface.register("sdpa", sdpa_attention_forward)
    on_revert(feature, lambda: AttentionInterface.register("sdpa", upstream))


def _packed(upstream, module, query, key, value, attention_mask, scaling, kwargs):
    """Upstream's ``pack_gqa`` one-token form through sdpa (the query heads of one KV head as the kernel's rows)."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None
