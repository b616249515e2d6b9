"""Tensor-parallel plan fixes: check a model's TP plan against its config before any weight is read.

transformers shards a model at load time with ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))``
following the model's ``tp_plan``. Some plans cannot work for some ``tp_size``; upstream then fails in the first
forward with a shape error. With hf_tpu enabled (``hf_tpu.enable()``, integration ``"tensor_parallel"``), the plan
is checked right after the model is built on the meta device and before the checkpoint is read:

- attention heads or KV heads not divisible by ``tp_size`` (GLM-4-9B: 2 KV heads on 4 chips): the attention block
  is replicated on every rank (its rules are dropped; MLP, embeddings and head stay sharded), and a warning says so;
  with :func:`set_kv_heads_strategy` ``("repeat")`` the query heads stay sharded instead and each rank computes the
  one KV head they use;
- vocabulary not divisible by ``tp_size``: kept sharded, the last rank holds the shorter slice (upstream supports
  uneven shards); an info line says so;
- tied word embeddings (Qwen3-0.6B): the input embedding and the LM head must shard their shared weight the same
  way; a default plan that disagrees is aligned, so the weights load once and stay tied;
- user ``tp_plan`` overrides (``DistributedConfig(tp_plan={...})``) are merged over the model's plan, as upstream
  does, and honoured as given: a user rule that cannot work is an error, never silently rewritten;
- impossible requests (``tp_size`` larger than the job, a world that the mesh does not fill, a process not started
  by a launcher) fail before loading, with what to run instead;
- ``from_pretrained(..., tp_plan="auto", device_mesh=mesh["tp"])`` (the mesh's ``tp`` dimension, e.g. of a
  ``(dp_shard, tp)`` training mesh): transformers 5.24 documents ``device_mesh`` but drops it and derives
  ``tp_size`` from ``WORLD_SIZE``, so 4 ranks shard over all 4 although the mesh's ``tp`` has 2. hf_tpu shards over
  the mesh given (:func:`load_kwargs_for_mesh`).

The checks are pure functions over a plan and a config (:func:`fix_plan`), unit-tested on CPU.

Example:
    >>> import hf_tpu; hf_tpu.enable("tensor_parallel")                          # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=4))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from hf_tpu.errors import UserError

__all__ = [
    "KV_HEADS_STRATEGIES",
    "PlanFix",
    "PlanReport",
    "TensorParallelConfigError",
    "apply",
    "check_world",
    "fix_plan",
    "load_kwargs_for_mesh",
    "set_kv_heads_strategy",
    "sharding_over",
    "weight_placement",
]

logger = logging.getLogger("hf_tpu.tp")

FEATURE = "tensor_parallel"
TRANSFORMERS_VERSIONS = ">=5.24,<6"

# Projections whose output holds attention heads (query, key, value, fused), and the styles that split them.
_HEAD_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "q_a_proj", "q_b_proj", "kv_b_proj"}
_KEY_PROJECTIONS = {"k_proj", "v_proj", "qkv_proj", "query_key_value", "kv_b_proj"}
_HEAD_SPLITTING_STYLES = {"colwise", "packed_colwise", "local_colwise"}
# Styles that split heads or expect their input split by heads: impossible in a replicated attention block.
_HEAD_SHARDED_STYLES = _HEAD_SPLITTING_STYLES | {"rowwise", "packed_rowwise", "local_rowwise"}


class TensorParallelConfigError(UserError, ValueError):
    """A tensor-parallel request that cannot work: what was asked, what was found, what to do."""


@dataclass(frozen=True)
class PlanFix:
    """One change hf_tpu made to a TP plan (or a condition it checked and accepted), with the reason.

    Attributes:
        kind: ``"replicate_attention"``, ``"repeat_kv_heads"``, ``"uneven_vocab"`` or ``"tie_embeddings"``.
        rules: the plan keys concerned.
        reason: what was changed and why, in words.
    """

    kind: str  # "replicate_attention" | "uneven_vocab" | "tie_embeddings"
    rules: tuple[str, ...]  # the plan keys concerned
    reason: str


@dataclass
class PlanReport:
    """What :func:`fix_plan` returns.

    Attributes:
        plan: the TP plan to use (module pattern -> style).
        fixes: each change made to the plan asked for (or condition checked and accepted), with its reason.
    """

    plan: dict[str, str]
    fixes: list[PlanFix] = field(default_factory=list)

    def kinds(self) -> list[str]:
        """The kinds of the fixes, in order.

        Returns:
            ``"replicate_attention"``, ``"uneven_vocab"``, ``"tie_embeddings"``, ... one per fix.
        """
        return [f.kind for f in self.fixes]


def weight_placement(style: str | None, *, embedding: bool) -> str:
    """How a TP style lays out a module's ``weight``: ``"shard0"``, ``"shard1"`` or ``"replicate"``.

    Args:
        style: a TP style of transformers or hf_tpu (``"colwise"``, ``"embedding_rowwise"``, ...); None: no rule.
        embedding: whether the module is an embedding (its weight is ``(vocab, hidden)``, not ``(out, in)``).

    Returns:
        ``"shard0"`` (split along the first dimension), ``"shard1"`` (the second) or ``"replicate"``.

    Example:
        >>> weight_placement("embedding_rowwise", embedding=True), weight_placement("colwise_gather_output", embedding=False)
        ('shard0', 'shard0')
    """
    if style is None or style in ("replicate", "replicated_with_grad_allreduce", "all_reduce", "local_params"):
        return "replicate"
    if embedding:
        return {"embedding_rowwise": "shard0", "embedding_colwise": "shard1"}.get(style, "replicate")
    if style.startswith("colwise") or style == "packed_colwise":
        return "shard0"
    if style.startswith("rowwise") or style == "packed_rowwise":
        return "shard1"
    return "replicate"


def _text_attr(config: Any, *names: str, default: Any = None) -> Any:
    getter = getattr(config, "get_text_config", None)
    text = getter(decoder=True) if callable(getter) else config
    for name in names:
        value = getattr(text, name, None)
        if value is not None:
            return value
    return default


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if v is not None]


def _attention_groups(plan: Mapping[str, str]) -> dict[str, list[str]]:
    """Attention blocks whose heads the plan splits: ``{"model.layers.*.self_attn": [rules...]}``."""
    prefixes = {
        key.rsplit(".", 1)[0]
        for key, style in plan.items()
        if "." in key and key.rsplit(".", 1)[1] in _HEAD_PROJECTIONS and style in _HEAD_SPLITTING_STYLES
    }
    return {p: sorted(k for k in plan if k == p or k.startswith(p + ".")) for p in sorted(prefixes)}


KV_HEADS_STRATEGIES = ("replicate", "repeat")
# Names of the styles the "repeat" strategy registers in transformers' ALL_PARALLEL_STYLES (one per head count).
_KV_SELECT_STYLE = "hf_tpu_kv_head_select_{kv}"
_LOCAL_GQA_STYLE = "hf_tpu_local_gqa_{heads}"


def _repeat_kv_rules(
    prefix: str,
    rules: list[str],
    plan: Mapping[str, str],
    heads: list[int],
    kv_heads: list[int],
    tp_size: int,
    user: set[str],
) -> dict[str, str] | None:
    """The rules of the "repeat" strategy for one attention block, or None when it does not apply."""
    if len(set(heads)) != 1 or len(set(kv_heads)) != 1:
        return None  # per-layer head counts: not handled
    h, kv = heads[0], kv_heads[0]
    if h % tp_size or tp_size % kv:
        return None
    names = {r.rsplit(".", 1)[-1]: r for r in rules}
    k, v = names.get("k_proj"), names.get("v_proj")
    if not k or not v or plan[k] != "colwise" or plan[v] != "colwise" or user & {k, v, prefix}:
        return None  # fused or unusual projections, or the user's own rules: keep to replication
    if any(r.rsplit(".", 1)[-1] in ("qkv_proj", "query_key_value", "kv_b_proj") for r in rules):
        return None
    select = _KV_SELECT_STYLE.format(kv=kv)
    return {k: select, v: select, prefix: _LOCAL_GQA_STYLE.format(heads=h)}


def fix_plan(
    plan: Mapping[str, str],
    config: Any,
    tp_size: int,
    *,
    user_rules: Iterable[str] = (),
    tied_embeddings: bool | None = None,
    embedding_key: str | None = None,
    head_key: str | None = None,
    kv_heads_strategy: str = "replicate",
) -> PlanReport:
    """Check ``plan`` (already merged with the user's overrides) against ``config`` for ``tp_size`` ranks.

    ``kv_heads_strategy`` says what to do with an attention block whose KV heads do not divide by ``tp_size``:
    ``"replicate"`` (default) runs the whole block on every rank; ``"repeat"`` keeps the query heads and the output
    projection sharded and gives each rank the one KV head its query heads use (each KV head is in effect repeated
    ``tp_size / kv_heads`` times), which needs ``tp_size`` to be a multiple of the KV heads and the query heads to
    divide by ``tp_size``; otherwise it falls back to ``"replicate"``.

    Returns the plan to use and the fixes made. Rules named in ``user_rules`` are never rewritten: if one of
    them cannot work, :class:`TensorParallelConfigError` says why and what to change.

    Args:
        plan: module pattern -> TP style (``"colwise"``, ``"rowwise"``, ``"embedding_rowwise"``, ...), the model's
            ``base_model_tp_plan`` merged with the user's ``tp_plan``.
        config: the model config (its text config's head counts, ``vocab_size``, ``tie_word_embeddings``).
        tp_size: the number of tensor-parallel ranks.
        user_rules: the patterns the user gave; they are kept as given or refused, never rewritten.
        tied_embeddings: whether the input embedding and the LM head share their weight; None (the default)
            reads ``config.tie_word_embeddings``.
        embedding_key: the plan's pattern of the input embedding, for the tied-weight and vocabulary checks;
            None skips them.
        head_key: the plan's pattern of the LM head, likewise.
        kv_heads_strategy: ``"replicate"`` (the default) or ``"repeat"``, see above.

    Returns:
        A ``PlanReport``: ``plan``, the plan to use, and ``fixes``, each change made with its reason
        (``report.kinds()`` lists their kinds).

    Raises:
        TensorParallelConfigError: ``tp_size`` below 1, a user rule that cannot work with these heads or tied
            embeddings, or a vocabulary smaller than ``tp_size``.
        ValueError: ``kv_heads_strategy`` is not one of ``KV_HEADS_STRATEGIES``.

    Example:
        >>> from types import SimpleNamespace as C
        >>> cfg = C(num_attention_heads=8, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)
        >>> plan = {"model.layers.*.self_attn.k_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
        ...         "model.layers.*.mlp.up_proj": "colwise"}
        >>> report = fix_plan(plan, cfg, 4)
        >>> report.plan, report.kinds()
        ({'model.layers.*.mlp.up_proj': 'colwise'}, ['replicate_attention'])
    """
    if tp_size < 1:
        raise TensorParallelConfigError(f"tp_size must be >= 1, got {tp_size}.")
    if kv_heads_strategy not in KV_HEADS_STRATEGIES:
        raise TensorParallelConfigError(
            f"kv_heads_strategy must be one of {KV_HEADS_STRATEGIES}, got {kv_heads_strategy!r}"
        )
    fixed = dict(plan)
    report = PlanReport(fixed)
    if tp_size == 1 or not fixed:
        return report
    user = set(user_rules)

    # 1. Heads: every attention block whose heads the plan splits needs heads and KV heads divisible by tp_size.
    heads = _as_list(_text_attr(config, "num_attention_heads", "n_head", "num_heads"))
    kv_heads = _as_list(_text_attr(config, "num_key_value_heads", "multi_query_group_num", "num_kv_heads")) or heads
    bad = [h for h in heads if h % tp_size] + [h for h in kv_heads if h % tp_size]
    if bad:
        parts = []
        if bad_kv := sorted({h for h in kv_heads if h % tp_size}):
            parts.append(f"{'/'.join(map(str, bad_kv))} KV heads")
        if bad_q := sorted({h for h in heads if h % tp_size}):
            parts.append(f"{'/'.join(map(str, bad_q))} attention heads")
        what = " and ".join(parts)
        for prefix, rules in _attention_groups(fixed).items():
            # A fused/key projection is what fails; a block that splits only q_proj heads fails too when H % tp.
            splits_kv = any(r.rsplit(".", 1)[-1] in _KEY_PROJECTIONS for r in rules)
            if not splits_kv and not [h for h in heads if h % tp_size]:
                continue
            # A user rule that splits heads (or expects split heads) cannot work here: say so. Other user rules in
            # the block (say a gathered k_proj) are kept as given; the model's own rules are dropped.
            if conflicting := sorted(r for r in user & set(rules) if fixed[r] in _HEAD_SHARDED_STYLES):
                raise TensorParallelConfigError(
                    f"your tp_plan rules {conflicting} split the heads of {prefix} over tp_size={tp_size}, but "
                    f"the model's {what} do not divide by {tp_size}. Drop those rules (hf_tpu then "
                    f"replicates this attention block), or use a tp_size that divides the head counts."
                )
            if kv_heads_strategy == "repeat" and (
                repeat := _repeat_kv_rules(prefix, rules, fixed, heads, kv_heads, tp_size, user)
            ):
                fixed.update(repeat)
                report.fixes.append(
                    PlanFix(
                        "repeat_kv_heads",
                        tuple(sorted(repeat)),
                        f"the model's {what} do not divide by tp_size={tp_size}: in {prefix} each rank keeps its "
                        f"{heads[0] // tp_size} query head(s) and the one KV head they use (each KV head computed on "
                        f"{tp_size // kv_heads[0]} ranks); q/o projections stay sharded",
                    )
                )
                continue
            dropped = [r for r in rules if r not in user]
            for rule in dropped:
                del fixed[rule]
            kept = [r for r in rules if r in user]
            report.fixes.append(
                PlanFix(
                    "replicate_attention",
                    tuple(dropped),
                    f"the model's {what} do not divide by tp_size={tp_size}: {prefix} is replicated on every rank "
                    f"(rules dropped: {', '.join(r.rsplit('.', 1)[-1] for r in dropped)}"
                    + (f"; your rules kept: {', '.join(r.rsplit('.', 1)[-1] for r in kept)}" if kept else "")
                    + "); the other layers stay sharded",
                )
            )

    # 2. Tied embeddings: the shared weight must be laid out the same way by both rules.
    tied = (
        bool(_text_attr(config, "tie_word_embeddings", default=False)) if tied_embeddings is None else tied_embeddings
    )
    if tied and embedding_key and head_key:
        emb_style, head_style = fixed.get(embedding_key), fixed.get(head_key)
        emb_p = weight_placement(emb_style, embedding=True)
        head_p = weight_placement(head_style, embedding=False)
        if emb_p != head_p:
            if user & {embedding_key, head_key}:
                raise TensorParallelConfigError(
                    f"the word embeddings are tied ({embedding_key}.weight is {head_key}.weight), but your tp_plan "
                    f"lays the shared weight out two ways ({embedding_key}: {emb_style or 'replicated'} -> {emb_p}, "
                    f"{head_key}: {head_style or 'replicated'} -> {head_p}). Use 'embedding_rowwise' with "
                    f"'colwise_gather_output' (both split the vocabulary), or leave both unsharded."
                )
            if emb_p == "shard0" and head_p == "replicate":
                fixed[head_key] = "colwise_gather_output"
            elif head_p == "shard0" and emb_p == "replicate":
                fixed[embedding_key] = "embedding_rowwise"
            else:  # anything else: keep the shared weight whole
                fixed.pop(embedding_key, None)
                fixed.pop(head_key, None)
            report.fixes.append(
                PlanFix(
                    "tie_embeddings",
                    (embedding_key, head_key),
                    f"tied embeddings: {embedding_key} ({emb_style}) and {head_key} ({head_style}) now lay the "
                    f"shared weight out the same way ({fixed.get(embedding_key)} / {fixed.get(head_key)})",
                )
            )

    # 3. Vocabulary not divisible: upstream shards unevenly (the last rank holds fewer rows); say so.
    vocab = _text_attr(config, "vocab_size")
    vocab_rules = tuple(
        k
        for k in (embedding_key, head_key)
        if k and weight_placement(fixed.get(k), embedding=(k == embedding_key)) == "shard0"
    )
    if isinstance(vocab, int) and vocab % tp_size and vocab_rules:
        if vocab < tp_size:
            raise TensorParallelConfigError(
                f"the vocabulary has {vocab} entries, fewer than tp_size={tp_size}: some ranks would hold no row. "
                f"Use tp_size <= {vocab}."
            )
        per = -(-vocab // tp_size)
        report.fixes.append(
            PlanFix(
                "uneven_vocab",
                vocab_rules,
                f"vocab_size={vocab} does not divide by tp_size={tp_size}: ranks hold {per} rows, the last "
                f"{vocab - per * (tp_size - 1)}; logits are gathered to the full vocabulary",
            )
        )
    return report


def check_world(tp_size: int, mesh_size: int, *, world_size: int | None, launched: bool) -> None:
    """Fail early, with the command to run, when the job cannot hold the requested mesh.

    Args:
        tp_size: the tensor-parallel size asked for.
        mesh_size: the processes the whole mesh needs (pp * dp_replicate * fsdp * tp).
        world_size: the job's ``WORLD_SIZE``; None when unknown (then only ``launched`` is checked).
        launched: whether a launcher started this process (``RANK``/``WORLD_SIZE`` set).

    Raises:
        TensorParallelConfigError: not launched, or a world size the mesh does not fill exactly (the message names
            the launch command or sizes that work).

    Example:
        >>> try:
        ...     check_world(4, 4, world_size=2, launched=True)
        ... except TensorParallelConfigError as err:
        ...     print(str(err).split(". ")[0])
        DistributedConfig(tp_size=4) needs 4 processes (pp*dp_replicate*fsdp*tp), but this job has WORLD_SIZE=2
    """
    if not launched:
        raise TensorParallelConfigError(
            f"DistributedConfig(tp_size={tp_size}) needs {mesh_size} processes, one per TPU chip, but this process was "
            f"not started by a launcher (RANK/WORLD_SIZE are unset). Run it with "
            f"`hf-tpu launch --nproc_per_node={mesh_size} your_script.py` (add --simulate without TPU chips)."
        )
    if world_size is not None and world_size != mesh_size:
        other = max(1, mesh_size // max(1, tp_size))  # pp * dp_replicate * fsdp
        if world_size > mesh_size and world_size % other == 0:
            hint = f"tp_size={world_size // other}, or --nproc_per_node={mesh_size}"
            if world_size % mesh_size == 0:  # a 2-D job: the TP mesh is one dimension of a larger one
                hint += (
                    f", or build your own mesh with a 'tp' dimension of {tp_size} and load with "
                    f"from_pretrained(..., tp_plan='auto', device_mesh=mesh['tp'])"
                )
        else:
            hint = f"--nproc_per_node={mesh_size}"
        raise TensorParallelConfigError(
            f"DistributedConfig(tp_size={tp_size}) needs {mesh_size} processes (pp*dp_replicate*fsdp*tp), but this "
            f"job has WORLD_SIZE={world_size}. Launch with {hint}, so that the mesh fills the job exactly."
        )


# -- transformers integration -----------------------------------------------------------------------------------

_SETTINGS: dict[str, str] = {"kv_heads": "replicate"}
_REGISTERED_STYLES: set[str] = set()


def set_kv_heads_strategy(strategy: str) -> str:
    """Choose what loading does with attention whose KV heads do not divide by ``tp_size``; returns the previous one.

    ``"replicate"`` (default): the block runs whole on every rank. ``"repeat"``: query heads and the output
    projection stay sharded, each rank computes the one KV head its query heads use (see :func:`fix_plan`).

    Args:
        strategy: one of :data:`KV_HEADS_STRATEGIES` (``"replicate"``, ``"repeat"``).

    Returns:
        The strategy in force before the call.

    Raises:
        ValueError (TensorParallelConfigError): an unknown strategy.

    Example:
        >>> previous = set_kv_heads_strategy("repeat")
        >>> set_kv_heads_strategy(previous)
        'repeat'
    """
    if strategy not in KV_HEADS_STRATEGIES:
        raise TensorParallelConfigError(f"kv heads strategy must be one of {KV_HEADS_STRATEGIES}, got {strategy!r}")
    previous, _SETTINGS["kv_heads"] = _SETTINGS["kv_heads"], strategy
    return previous


def _ensure_styles(plan: Mapping[str, str]) -> None:
    """Register in transformers' ALL_PARALLEL_STYLES the hf_tpu styles that ``plan`` names."""
    from torch import nn
    from torch.nn import functional as F
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    class KVHeadSelect(TensorParallelLayer):
        """k_proj/v_proj kept whole; each rank computes only the KV head its query heads use."""

        def __init__(self, kv_heads: int):
            self.kv_heads = kv_heads

        # (transformers 5.25's TensorParallelLayer.install_forward also takes keyword-only config= and
        # mesh_manager=, which its caller passes; 5.24's takes neither. These styles need neither.)
        def install_forward(self, module, mesh, **_upstream_keywords):
            tp = mesh.size()
            index = mesh.get_local_rank() // (tp // self.kv_heads)
            width = module.out_features // self.kv_heads
            lo, hi = index * width, (index + 1) * width
            original = module.forward
            if isinstance(module, nn.Linear):

                @functools.wraps(original)
                def forward(x, *args, **kwargs):
                    bias = module.bias[lo:hi] if module.bias is not None else None
                    return F.linear(x, module.weight[lo:hi], bias)

            else:

                @functools.wraps(original)
                def forward(*args, **kwargs):
                    return original(*args, **kwargs)[..., lo:hi]

            module.forward = forward
            return module

    class LocalGQA(TensorParallelLayer):
        """The attention block sees H/tp query heads and one KV head: its GQA group size is H/tp."""

        def __init__(self, heads: int):
            self.heads = heads

        def install_forward(self, module, mesh, **_upstream_keywords):  # (see KVHeadSelect's)
            module.num_key_value_groups = self.heads // mesh.size()
            return module

    for style in set(plan.values()):
        if style in _REGISTERED_STYLES or not style.startswith("hf_tpu_"):
            continue
        count = int(style.rsplit("_", 1)[1])
        if style.startswith("hf_tpu_kv_head_select_"):
            ALL_PARALLEL_STYLES[style] = KVHeadSelect(count)
        elif style.startswith("hf_tpu_local_gqa_"):
            ALL_PARALLEL_STYLES[style] = LocalGQA(count)
        _REGISTERED_STYLES.add(style)


def _forget_styles() -> None:
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    for style in list(_REGISTERED_STYLES):
        try:
            del ALL_PARALLEL_STYLES[style]
        except KeyError:
            pass
        _REGISTERED_STYLES.discard(style)


def _kv_heads_with_repeat(original):
    """Wrap ``transformers.generation.utils.get_kv_heads_per_rank`` (transformers >=5.24,<6): with the "repeat"
    strategy each rank holds one KV head, which the static cache must be sized for."""

    @functools.wraps(original)
    def get_kv_heads_per_rank(tp_plan, num_heads, tp_size):
        if tp_plan and any(str(style).startswith("hf_tpu_kv_head_select_") for style in tp_plan.values()):
            return 1 if isinstance(num_heads, int) else [1] * len(num_heads)
        return original(tp_plan, num_heads, tp_size)

    return get_kv_heads_per_rank


def _rank0() -> bool:
    try:
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0
    except (RuntimeError, ValueError):  # pragma: no cover
        return True


def _module_key(model: Any, module: Any) -> str | None:
    if module is None:
        return None
    for name, mod in model.named_modules():
        if mod is module:
            return name
    return None


def _resolve_with_fixes(original):
    """Wrap ``DistributedMixin._resolve_parallel_plans`` (transformers >=5.24,<6).

    Upstream merges the user's ``tp_plan`` over the model's and shards by it whatever the config says; the
    wrapper first runs :func:`fix_plan` on the merged plan and stores the fixed plan on the model
    (``model._tp_plan``, which generation also reads to size the static cache), its fixes (``_hf_tpu_tp_fixes``) and
    the KV-heads strategy (``_hf_tpu_kv_heads_strategy``), then lets upstream proceed. Needed as long as upstream
    does not check heads against ``tp_size`` (still the case in 5.24).
    """

    @functools.wraps(original)
    def _resolve_parallel_plans(self, distributed_config):
        tp_size = getattr(distributed_config, "tp_size", 1) or 1
        if tp_size > 1:
            override = distributed_config.tp_plan if isinstance(distributed_config.tp_plan, dict) else None
            if override == {}:
                return original(self, distributed_config)
            merged = dict(self.tp_plan or {}) | (override or {})
            try:
                emb = _module_key(self, self.get_input_embeddings())
            except (NotImplementedError, AttributeError):
                emb = None
            try:
                head = _module_key(self, self.get_output_embeddings())
            except (NotImplementedError, AttributeError):
                head = None
            report = fix_plan(
                merged,
                self.config,
                tp_size,
                user_rules=(override or {}).keys(),
                embedding_key=emb,
                head_key=head,
                kv_heads_strategy=_SETTINGS["kv_heads"],
            )
            _ensure_styles(report.plan)
            if report.fixes:
                # Upstream merges `plan | override` again; user rules are unchanged in the fixed plan.
                self._tp_plan = report.plan
                if _rank0():
                    for fix in report.fixes:
                        level = logging.INFO if fix.kind == "uneven_vocab" else logging.WARNING
                        logger.log(level, "hf_tpu tensor parallel: %s", fix.reason)
            self._hf_tpu_tp_fixes = list(report.fixes)
            # The strategy this model was loaded with (the setting is process-wide and may change later): the
            # compile cache keys the model's graphs by it (hf_tpu.compile_cache._parallel_layout).
            self._hf_tpu_kv_heads_strategy = _SETTINGS["kv_heads"]
        return original(self, distributed_config)

    return _resolve_parallel_plans


_USER_MESH: contextvars.ContextVar[Any] = contextvars.ContextVar("hf_tpu_tp_user_mesh", default=None)


def load_kwargs_for_mesh(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """Turn ``from_pretrained``'s ``device_mesh=`` into the ``DistributedConfig`` that shards over that mesh.

    transformers 5.24 documents ``from_pretrained(..., tp_plan=..., device_mesh=mesh)`` ("it has to contain a
    dimension named 'tp' ... this dimension will be used for tensor parallelism") but pops ``device_mesh`` and never
    reads it: ``DistributedConfig(tp_plan="auto")`` then takes ``tp_size = WORLD_SIZE`` and builds a mesh over the
    whole job. On a ``(dp_shard=2, tp=2)`` mesh of 4 ranks the model was sharded 4 ways. Given a mesh, this returns
    the keyword arguments with ``distributed_config=DistributedConfig(tp_plan=..., tp_size=<the mesh's tp size>)``
    (``device_mesh``/``tp_plan``/``tp_size`` removed) and the 1-D ``tp`` mesh, which the wrapped
    ``initialize_distributed_mesh`` then uses instead of building one (see :func:`apply`). Without a mesh, or with a
    mesh but no tensor-parallel request (upstream uses it for nothing else), the arguments are returned unchanged
    with ``None``.

    Args:
        kwargs: the keyword arguments of ``from_pretrained`` (``device_mesh``, ``tp_plan``, ``tp_size``,
            ``distributed_config`` and the rest).

    Returns:
        ``(kwargs, mesh)``: a new dict of keyword arguments to pass upstream, and the 1-D ``tp`` mesh to shard over
        (None when there is none).

    Raises:
        TensorParallelConfigError: a mesh of more than one dimension with no ``tp`` dimension, a ``tp_size`` or
            ``DistributedConfig`` that disagrees with the mesh, or a ``DistributedConfig`` asking transformers for
            FSDP/pipeline/expert parallelism on top of a mesh of the caller's (build those over your own mesh).
    """
    mesh = kwargs.get("device_mesh")
    config, tp_plan, tp_size = kwargs.get("distributed_config"), kwargs.get("tp_plan"), kwargs.get("tp_size")
    if mesh is None or (config is None and tp_plan is None and tp_size is None):
        return dict(kwargs), None
    if mesh.ndim > 1:
        if "tp" not in (mesh.mesh_dim_names or ()):
            raise TensorParallelConfigError(
                f"from_pretrained(device_mesh=...) got a {mesh.ndim}-D mesh with dimensions {mesh.mesh_dim_names} and "
                "no 'tp' dimension: name the tensor-parallel dimension 'tp', or pass the 1-D mesh, device_mesh=mesh['tp']."
            )
        mesh = mesh["tp"]
    size = mesh.size()
    asked = tp_size if config is None else getattr(config, "tp_size", None)
    if asked not in (None, size):
        raise TensorParallelConfigError(
            f"tp_size={asked} but device_mesh's 'tp' dimension has {size} ranks: drop tp_size (the mesh decides) "
            f"or pass a mesh whose 'tp' dimension has {asked}."
        )
    if config is not None:
        others = {
            k: getattr(config, k, 1)
            for k in ("fsdp_size", "dp_replicate_size", "pp_size", "ep_size")
            if (getattr(config, k, 1) or 1) > 1
        }
        if others:
            raise TensorParallelConfigError(
                f"from_pretrained got device_mesh and a DistributedConfig that also asks for {others}: transformers "
                "builds those over a mesh of its own. Pass DistributedConfig alone (with all its sizes), or "
                "device_mesh=mesh['tp'] with tp_plan and apply FSDP over your mesh yourself (fully_shard, accelerate)."
            )
    from transformers.distributed import DistributedConfig

    out = {k: v for k, v in kwargs.items() if k not in ("device_mesh", "tp_plan", "tp_size", "distributed_config")}
    plan = tp_plan if config is None else config.tp_plan
    out["distributed_config"] = DistributedConfig(tp_plan=plan if plan is not None else "auto", tp_size=size)
    return out, mesh


@contextlib.contextmanager
def sharding_over(mesh: Any) -> Iterator[None]:
    """Within the block, transformers' ``initialize_distributed_mesh`` answers with ``mesh`` (a 1-D ``tp`` mesh
    from :func:`load_kwargs_for_mesh`) instead of building a mesh over the whole job; ``None`` changes nothing.

    Args:
        mesh: the 1-D ``tp`` device mesh, or None.
    """
    token = _USER_MESH.set(mesh)
    try:
        yield
    finally:
        _USER_MESH.reset(token)


class _GivenTpMesh:
    """What transformers' loading asks of its mesh manager (``get_mesh(dims)``), answered by the caller's 1-D ``tp``
    mesh: every other dimension (pp, fsdp, dp_replicate) has size 1, so any selection of dimensions is that mesh."""

    def __init__(self, mesh: Any):
        self._mesh = mesh

    def get_mesh(self, dims: str | tuple[str, ...]) -> Any:
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        if "ep" in dims or "efsdp" in dims:
            raise TensorParallelConfigError(
                "expert parallelism over a device_mesh passed to from_pretrained is not supported: use "
                "DistributedConfig(ep_size=...) without device_mesh."
            )
        return self._mesh


def _mesh_with_checks(original):
    """Wrap ``transformers.distributed.mixin.initialize_distributed_mesh`` (transformers >=5.24,<6).

    Upstream tries ``init_process_group`` and reports a failure as "We tried to initialize torch.distributed for
    you, but it failed", or a mesh/world mismatch without saying what to run. The wrapper checks the job first
    (:func:`check_world`) and, on the simulator, registers the simulated ``tpu_dist`` backend that upstream picks
    for the ``tpu`` device.
    """

    @functools.wraps(original)
    def initialize_distributed_mesh(distributed_config):
        import torch
        import torch.distributed as dist

        sizes = (
            distributed_config.pp_size,
            distributed_config.dp_replicate_size,
            distributed_config.fsdp_size,
            distributed_config.tp_size,
        )
        mesh_size = 1
        for s in sizes:
            mesh_size *= int(s)
        given = _USER_MESH.get()
        if given is not None and mesh_size == given.size():
            # from_pretrained(device_mesh=...): shard over the caller's tp mesh (its process group exists already).
            device = torch.device(given.device_type)
            if given.device_type != "cpu":
                device = torch.device(given.device_type, torch.accelerator.current_device_index())
                torch.accelerator.set_device_index(device.index)
            return device, _GivenTpMesh(given)
        if mesh_size > 1:
            if dist.is_initialized():
                check_world(distributed_config.tp_size, mesh_size, world_size=dist.get_world_size(), launched=True)
            else:
                launched = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
                world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
                check_world(distributed_config.tp_size, mesh_size, world_size=world, launched=launched)
            from hf_tpu import runtime

            side = runtime.simulated_distributed()
            if side is not None and torch._C._get_accelerator().type == "tpu":
                side.register()
        return original(distributed_config)

    return initialize_distributed_mesh


def apply() -> None:
    """Install the plan checks in transformers (``hf_tpu.enable("tensor_parallel")``)."""
    from transformers.distributed import mixin
    from transformers.generation import utils as generation_utils

    from hf_tpu._patch import on_revert, original, patch

    patch(
        mixin.DistributedMixin,
        "_resolve_parallel_plans",
        _resolve_with_fixes(original(mixin.DistributedMixin, "_resolve_parallel_plans")),
        feature=FEATURE,
        package="transformers",
        versions=TRANSFORMERS_VERSIONS,
    )
    patch(
        mixin,
        "initialize_distributed_mesh",
        _mesh_with_checks(original(mixin, "initialize_distributed_mesh")),
        feature=FEATURE,
        package="transformers",
        versions=TRANSFORMERS_VERSIONS,
    )
    patch(
        generation_utils,
        "get_kv_heads_per_rank",
        _kv_heads_with_repeat(original(generation_utils, "get_kv_heads_per_rank")),
        feature=FEATURE,
        package="transformers",
        versions=TRANSFORMERS_VERSIONS,
    )
    on_revert(FEATURE, _forget_styles)
