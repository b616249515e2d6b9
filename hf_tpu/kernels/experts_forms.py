"""MoE experts forms for a TPU, and the per-bucket choice between them from times measured on a chip.

An experts layer (T tokens, each routed to ``top_k`` of E experts) can run in several forms, and which is fastest
depends on T: at decode sizes the layer should read only the routed experts' weights, at large T every expert's
weights once. The forms:

- ``"slots"`` (torch, here): one matrix-vector product per routed (token, slot) pair, the expert's weights picked
  by a one-element ``index_select``: reads T x top_k experts' weights; a loop unrolled in the graph, so a decode
  form (at most :data:`MAX_SLOTS` pairs; a larger T runs ``grouped_mm``).
- ``"dense"`` (torch, here): every expert on every token, each token's results weighted by its routing (zero for
  the experts it did not choose): reads every weight once, E / top_k times the arithmetic of the routed work.
- ``"grouped_mm"`` (transformers' default; ``chlo.ragged_dot`` through torch_tpu) and ``"batched_mm"``
  (transformers: each slot's weights gathered).
- ``"kernel_decode"``, ``"kernel"``, ``"megablox"``: hf_tpu's ragged-dot Hub kernel (hub/ragged-dot-tpu) with its
  decode form (grid over the routed experts only), its visit form, or JAX's megablox ``gmm``; these run through
  ``torch.tpu.pallas.jax_op`` on a chip.

:func:`choose` picks, for one layer shape and token count, the form with the least time in the table of chip
measurements shipped with hf_tpu (``experts_v5e.json``, written by ``scripts/chip_bench.py``): the measured shape
nearest to the layer's (experts, top-k, bytes per expert) and the measured token count nearest to T, the form
fastest there. The experts implementation ``"hf_tpu_measured"`` (:data:`measured_experts_forward`, registered by
:func:`use_measured_experts`) asks :func:`choose` in each compiled graph, as a constant of the trace: T is static in
a bucket's graph, so each bucket (prefill, decode at each batch) runs its own measured-fastest form. It chooses
among :data:`DEFAULT_FORMS` (what torch_tpu lowers with the graph, so ``hf-tpu plan`` compiles exactly that);
``"hf_tpu_measured_kernels"`` among every form. :func:`prefer_measured` (called by warm-up and ``generate``) gives a
MoE on torch_tpu left at transformers' default the latter on a TPU VM (the kernel's forms run inside torch_tpu's
compiled graphs there: checked on a v5e with torch_tpu itself, docs/planning.md) and the former where the kernel cannot
run (a process lowering for ``hf-tpu plan`` without a chip: ``jax_op`` asks for the chip's client while lowering).

The choice is :data:`KERNEL_FORM` in hf_tpu's kernel forms (:mod:`hf_tpu.kernels.forms`): its forms, those that can
run here (:func:`available_forms`), the measured table, the override ``HF_TPU_MEASURED_EXPERTS`` (and per model
``model._hf_tpu_keep_experts`` or an ``experts_implementation`` asked for); each graph's choice goes through
:func:`hf_tpu.kernels.forms.choose_form`.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path
from typing import Any

from hf_tpu import _env
from hf_tpu.errors import InvalidArgumentError
from hf_tpu.kernels.forms import KernelForm, choose_form, kernel_form

__all__ = [
    "FORMS",
    "DEFAULT_FORMS",
    "KERNEL_FORM",
    "MARGIN",
    "MAX_SLOTS",
    "MEASURED_KERNELS_NAME",
    "MEASURED_ENV",
    "MEASURED_NAME",
    "TORCH_FORMS",
    "available_forms",
    "choose",
    "dense_experts_forward",
    "load_kernel_forms",
    "measured_experts_forward",
    "measured_kernels_experts_forward",
    "measured_name",
    "measured_table",
    "prefer_measured",
    "register_named",
    "slots_experts_forward",
    "use_measured_experts",
]

MEASURED_NAME = "hf_tpu_measured"
MEASURED_KERNELS_NAME = "hf_tpu_measured_kernels"
#: A model attribute: True keeps the model's experts implementation as it is (see :func:`prefer_measured`).
KEEP = "_hf_tpu_keep_experts"
TABLE = Path(__file__).with_name("experts_v5e.json")
#: The forms written in torch here (lowered by torch_tpu like the rest of the graph).
TORCH_FORMS = ("slots", "dense")
#: The Hub kernel's forms and the kernel implementation each runs.
KERNEL_FORMS = {"kernel_decode": "pallas_decode", "kernel": "pallas", "megablox": "megablox", "ragged_dot": "xla"}
#: Every form :func:`choose` may answer, in the order ties are broken (see :data:`MARGIN`).
FORMS = (*TORCH_FORMS, "grouped_mm", "batched_mm", *KERNEL_FORMS)
#: The forms ``"hf_tpu_measured"`` chooses from: those torch_tpu lowers with the rest of the graph without a chip,
#: so that ``hf-tpu plan`` compiles ahead what it lowers. The kernel's forms (``"hf_tpu_measured_kernels"``, the
#: default on a TPU VM) cross into JAX through ``torch.tpu.pallas.jax_op``, which needs the chip's client to lower.
DEFAULT_FORMS = ("slots", "dense", "grouped_mm")
#: The most (token, slot) pairs the slots form unrolls.
MAX_SLOTS = 64
#: Forms measured within this fraction of the fastest count as equally fast (median-to-median spread between two
#: runs of the same program on the v5e was a few percent); among those :func:`choose` takes the first in FORMS.
MARGIN = 0.05


def _fusable(module) -> bool:
    """transformers' default gate (``act(gate) * up`` on concatenated halves), no biases, no post-expert norm."""
    return (
        getattr(module, "has_gate", True)
        and getattr(module, "is_concatenated", True)
        and not getattr(module, "has_bias", False)
        and not getattr(module, "has_post_expert_norm", False)
    )


def _weights(module):
    """``(gate_up, down)`` as (E, 2I, H) and (E, H, I) views (transformers' layout, whatever ``is_transposed``)."""
    gate_up, down = module.gate_up_proj, module.down_proj
    if getattr(module, "is_transposed", False):  # stored (E, H, 2I) and (E, I, H)
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up, down


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Every expert on every token (transformers' experts interface): (T, H) -> (T, H).

    Two batched matmuls over all E experts, the gate, and a weighted sum with the (T, E) routing weights (zero where
    a token did not choose an expert; expert ids ``>= E``, expert parallelism's sentinels, choose nothing). No sort,
    gather or data-dependent shape: each weight is read once, whatever the routing.
    """
    import torch

    gate_up, down = _weights(self)
    num_experts = gate_up.shape[0]
    x = hidden_states.to(gate_up.dtype)
    h = torch.einsum("th,eih->eti", x, gate_up)
    h = self._apply_gate(h)
    y = torch.einsum("eti,ehi->eth", h.to(down.dtype), down)
    experts = torch.arange(num_experts, device=top_k_index.device)
    chosen = (top_k_index.unsqueeze(-1) == experts).to(top_k_weights.dtype)  # (T, k, E)
    scale = (chosen * top_k_weights.unsqueeze(-1)).sum(dim=1)  # (T, E)
    out = torch.einsum("eth,te->th", y.float(), scale.float())
    return out.to(hidden_states.dtype)


def slots_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """One product per routed (token, slot) pair (transformers' experts interface): (T, H) -> (T, H).

    Each pair picks its expert's two matrices with a one-element ``index_select`` (a dynamic slice once compiled),
    so the layer reads T x top_k experts' weights and nothing else. The loop is unrolled in the graph, so it is a
    decode form: past :data:`MAX_SLOTS` pairs (a prefill) the layer runs transformers' ``grouped_mm`` instead.
    """
    import torch

    num_tokens, top_k = top_k_index.shape
    if num_tokens * top_k > MAX_SLOTS:
        return _form_forward("grouped_mm")(self, hidden_states, top_k_index, top_k_weights)
    gate_up, down = _weights(self)
    num_experts = gate_up.shape[0]
    ids = top_k_index.reshape(-1)
    weights = top_k_weights.reshape(-1)
    x = hidden_states.to(gate_up.dtype)
    rows = []
    for t in range(num_tokens):
        acc = None
        for j in range(top_k):
            s = t * top_k + j
            e = ids[s : s + 1]
            valid = e < num_experts
            e = e.clamp(max=num_experts - 1)
            h = torch.matmul(gate_up.index_select(0, e)[0], x[t])  # (2I,)
            h = self._apply_gate(h.unsqueeze(0))[0]
            y = torch.matmul(down.index_select(0, e)[0], h.to(down.dtype)).float()
            y = y * torch.where(valid, weights[s : s + 1], torch.zeros_like(weights[s : s + 1])).float()
            acc = y if acc is None else acc + y
        rows.append(acc)
    return torch.stack(rows).to(hidden_states.dtype)


@functools.cache
def measured_table(path: str | None = None) -> dict[str, Any]:
    """The shipped chip measurements (``experts_v5e.json``): ``{"device", "date", "rows": [{"model", "hidden",
    "intermediate", "experts", "top_k", "tokens", "seconds": {form: s}}]}``."""
    return json.loads(Path(path or TABLE).read_text())


def _bytes_per_expert(hidden: int, intermediate: int) -> int:
    return 3 * hidden * intermediate


def choose(
    hidden: int,
    intermediate: int,
    experts: int,
    top_k: int,
    tokens: int,
    *,
    forms: tuple[str, ...] | None = None,
    table: dict | None = None,
) -> str:
    """The measured-fastest experts form for ``tokens`` tokens of this layer shape.

    Of the table's shapes, the nearest in (log experts, log top-k, log weights per expert); of its token counts, the
    nearest to ``tokens`` in log scale; of the forms measured there (and in ``forms``, when given), the fastest, where
    forms within :data:`MARGIN` of it count as tied and the first of them in :data:`FORMS` is taken. The slots form
    is never answered past :data:`MAX_SLOTS` (token, slot) pairs.

    Raises:
        ValueError: the table holds no row with a form in ``forms``.
    """
    rows = (table or measured_table())["rows"]

    own_bytes = _bytes_per_expert(hidden, intermediate)

    def shape_distance(r):
        return (
            abs(math.log(r["experts"] / experts))
            + abs(math.log(r["top_k"] / top_k))
            + abs(math.log(_bytes_per_expert(r["hidden"], r["intermediate"]) / own_bytes))
        )

    def usable(r):
        return {
            f: s for f, s in r["seconds"].items()
            if s is not None and (forms is None or f in forms) and (f != "slots" or tokens * top_k <= MAX_SLOTS)
        }  # fmt: skip

    candidates = [r for r in rows if usable(r)]
    if not candidates:
        measured = sorted({f for r in rows for f in r["seconds"]})
        raise InvalidArgumentError(f"no measured experts form among {forms}; the table has {measured}")
    nearest_shape = min(shape_distance(r) for r in candidates)
    same_shape = [r for r in candidates if shape_distance(r) == nearest_shape]
    row = min(same_shape, key=lambda r: abs(math.log(r["tokens"] / max(tokens, 1))))
    times = usable(row)
    fastest = min(times.values())
    # within the run-to-run spread of the measurements (MARGIN), the first in FORMS' order: the torch forms, which
    # torch_tpu lowers with the rest of the graph, before the kernel's, which cross into JAX through jax_op
    near = [f for f in FORMS if f in times and times[f] <= fastest * (1 + MARGIN)]
    return near[0] if near else min(times, key=times.get)


#: The Hub kernel's experts forward per kernel form, made by :func:`load_kernel_forms` before any trace.
_KERNEL_FORWARDS: dict[str, Any] = {}


def load_kernel_forms() -> dict[str, Any]:
    """Load the ragged-dot Hub kernel and make its experts forward for each form in :data:`KERNEL_FORMS`, once.

    Called outside any trace (by :func:`use_measured_experts` for ``"hf_tpu_measured_kernels"``, and so by
    :func:`prefer_measured` on a TPU VM): loading the kernel reads files (``os.stat``), which Dynamo cannot trace, so
    loading it inside a compiled bucket's trace broke the graph and ``generate`` fell back to upstream's eager loop
    (391 ms per decode step of the Qwen3-MoE shape on a v5e)."""
    if not _KERNEL_FORWARDS:
        from hf_tpu.kernels.loader import load_ragged_dot_kernel

        kernel = load_ragged_dot_kernel()
        _KERNEL_FORWARDS.update({form: kernel.make_experts_forward(impl) for form, impl in KERNEL_FORMS.items()})
    return _KERNEL_FORWARDS


def _kernel_forward(form: str):
    return (_KERNEL_FORWARDS or load_kernel_forms())[form]


def _form_forward(form: str):
    if form == "dense":
        return dense_experts_forward
    if form == "slots":
        return slots_experts_forward
    if form in KERNEL_FORMS:
        return _kernel_forward(form)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS[form]


def _layer_shape(module) -> tuple[int, int, int]:
    gate_up, down = _weights(module)
    return down.shape[1], down.shape[2], gate_up.shape[0]  # hidden, intermediate, experts


def _choice(hidden: int, intermediate: int, experts: int, top_k: int, tokens: int, forms: tuple[str, ...]) -> str:
    return choose_form("experts", hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k,
                       tokens=tokens, forms=forms)  # fmt: skip


def _constant_choice(*args) -> str:
    """:func:`choose` as a constant of the graph being traced: the shapes are static there, and the table is read
    outside the trace (Dynamo cannot trace reading a file; ``fullgraph=True`` would refuse the graph)."""
    return (_CONSTANT_CHOICE or _constant_choice_wrapper())(*args)


def _constant_choice_wrapper():
    """Made once, before any trace (by :func:`use_measured_experts`): Dynamo refuses to trace its making."""
    import torch

    global _CONSTANT_CHOICE
    kernel_form("experts")  # (the registry read here, outside any trace: the first read imports the forms)
    if _CONSTANT_CHOICE is None:
        _CONSTANT_CHOICE = torch.compiler.assume_constant_result(_choice)
    return _CONSTANT_CHOICE


_CONSTANT_CHOICE = None


def _measured_forward(forms: tuple[str, ...]):
    def experts_forward(self, hidden_states, top_k_index, top_k_weights):
        """transformers' experts interface: the form :func:`choose` answers for this layer's shape and token count.

        Layers transformers' default gate does not cover (biases, a custom gate, a post-expert norm) take
        ``grouped_mm``, the default form, which handles them all.
        """
        if not _fusable(self):
            return _form_forward("grouped_mm")(self, hidden_states, top_k_index, top_k_weights)
        hidden, intermediate, experts = _layer_shape(self)
        form = _constant_choice(int(hidden), int(intermediate), int(experts), int(top_k_index.shape[-1]),
                                int(hidden_states.shape[0]), forms)  # fmt: skip
        return _form_forward(form)(self, hidden_states, top_k_index, top_k_weights)

    return experts_forward


#: ``"hf_tpu_measured"``: the measured-fastest of :data:`DEFAULT_FORMS` per layer shape and token count.
measured_experts_forward = _measured_forward(DEFAULT_FORMS)
#: ``"hf_tpu_measured_kernels"``: the same over every form, the Hub kernel's included (a chip needed to lower).
measured_kernels_experts_forward = _measured_forward(FORMS)


def use_measured_experts(name: str = MEASURED_NAME) -> str:
    """Register :data:`measured_experts_forward` as ``"hf_tpu_measured"`` (with ``"hf_tpu_measured_kernels"`` and the
    torch forms as ``"hf_tpu_dense"`` / ``"hf_tpu_slots"``) in transformers' experts interface; returns ``name``, to
    pass as ``experts_implementation``. ``name`` ``"hf_tpu_measured_kernels"`` also loads the Hub kernel's forms
    (:func:`load_kernel_forms`), here, before any graph that runs them is traced.

    Raises:
        ValueError (InvalidArgumentError): ``name`` is neither of the two measured implementations.
    """
    from hf_tpu.kernels.registry import register_experts, registered_experts

    if name not in (MEASURED_NAME, MEASURED_KERNELS_NAME):
        raise InvalidArgumentError(f"{name!r} is not a measured experts implementation; use {MEASURED_NAME!r} or "
                                   f"{MEASURED_KERNELS_NAME!r}")  # fmt: skip
    _constant_choice_wrapper()
    if name == MEASURED_KERNELS_NAME:
        load_kernel_forms()
    ours = registered_experts()
    named = ((MEASURED_NAME, measured_experts_forward), (MEASURED_KERNELS_NAME, measured_kernels_experts_forward),
             ("hf_tpu_dense", dense_experts_forward), ("hf_tpu_slots", slots_experts_forward))  # fmt: skip
    for key, fn in named:
        if ours.get(key) is not fn:
            register_experts(key, fn, replace=key in ours)
    return name


def register_named(name: str) -> None:
    """Register what an ``experts_implementation`` name of hf_tpu's needs (the measured choice, its torch forms, the
    ragged-dot Hub kernel); other names (transformers' own) need nothing."""
    if name in (MEASURED_NAME, MEASURED_KERNELS_NAME, "hf_tpu_dense", "hf_tpu_slots"):
        use_measured_experts(name if name == MEASURED_KERNELS_NAME else MEASURED_NAME)
    elif name == "ragged_dot_tpu":
        from hf_tpu.kernels.registry import use_ragged_dot_experts

        use_ragged_dot_experts()


#: ``HF_TPU_MEASURED_EXPERTS``: ``auto`` (unset, or ``1``): every form on a TPU VM, the torch forms elsewhere;
#: ``torch``: the torch forms only (:data:`DEFAULT_FORMS`); ``0``: keep transformers' default.
MEASURED_ENV = _env.MEASURED_EXPERTS.name


def available_forms() -> tuple[str, ...]:
    """The experts forms that can run in this process: every form (:data:`FORMS`) on TPU chips with what the Hub
    kernel needs (``jax`` and ``kernels`` importable), else :data:`DEFAULT_FORMS` (no chip: ``jax_op`` cannot lower
    the kernel for ``hf-tpu plan``, and nothing runs it)."""
    import importlib.util

    from hf_tpu import runtime

    if runtime.detect().mode != "real":
        return DEFAULT_FORMS
    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("kernels") is None:
        return DEFAULT_FORMS  # the kernel's forms need both (pip install 'hf-tpu[tpu]')
    return FORMS


def _pick(override: str, **shape: Any) -> str:
    """The form for one layer shape and token count (:func:`choose`; the override chose the implementation, and so
    the ``forms`` in ``shape``, before any graph)."""
    return choose(**shape)


#: The experts' kernel form: the measured-fastest per layer shape and token count, from the shipped table.
KERNEL_FORM = KernelForm(
    "experts", FORMS, "a MoE layer's experts", override=_env.MEASURED_EXPERTS, table=measured_table,
    available=available_forms, pick=_pick,
    per_model="model._hf_tpu_keep_experts = True, or an experts_implementation asked for, keeps the model's own",
)  # fmt: skip


def measured_name() -> str:
    """The measured implementation :func:`prefer_measured` gives a model here: ``"hf_tpu_measured_kernels"`` (every
    form, the Hub kernel's included) in a process running on TPU chips with what the kernel needs (``jax`` and
    ``kernels`` importable), ``"hf_tpu_measured"`` (the torch forms) otherwise, or when ``HF_TPU_MEASURED_EXPERTS``
    is ``torch``.

    Raises:
        ValueError (InvalidArgumentError): ``HF_TPU_MEASURED_EXPERTS`` is not ``auto``, ``1``, ``torch`` or ``0``.
    """
    value = _env.MEASURED_EXPERTS.get()  # (a value it does not take raises, naming the ones it does)
    if value == "torch":
        return MEASURED_NAME
    return MEASURED_KERNELS_NAME if set(KERNEL_FORMS) <= set(KERNEL_FORM.usable()) else MEASURED_NAME


def prefer_measured(model) -> bool:
    """Give a TPU-placed MoE model hf_tpu's measured experts choice: a model whose experts run transformers' default
    (``grouped_mm``) switches to :func:`measured_name`'s implementation (on a TPU VM ``"hf_tpu_measured_kernels"``),
    so that each bucket's graph runs the form measured fastest for its token count. Returns whether it switched.
    ``HF_TPU_MEASURED_EXPERTS=0``, or ``model._hf_tpu_keep_experts = True``, keeps what the model has (transformers
    cannot tell a default ``grouped_mm`` from one asked for)."""
    config = getattr(model, "config", None)
    # (its text, not its parsed value: a value the table refuses is refused by measured_name, for an MoE model only)
    if _env.MEASURED_EXPERTS.text() == "0" or config is None or model.__dict__.get(KEEP, False):
        return False
    if getattr(config, "_experts_implementation", None) != "grouped_mm":
        return False
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if can_set is None or not can_set():
        return False
    sim = sys.modules.get("hf_tpu.sim")
    weight = next(iter(model.parameters()), None)
    if weight is None or weight.device.type != "tpu" or (sim is not None and sim.is_sim_tensor(weight)):
        return False  # measured on a chip: for torch_tpu's device (the simulator keeps transformers' default)
    name = measured_name()
    use_measured_experts(name)
    model.set_experts_implementation(name)
    return True
