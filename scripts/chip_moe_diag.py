"""Why a tiny Qwen3-MoE's greedy tokens on a TPU differ from the CPU's at batch 4 (issue #67): one diagnosis stage.

``stage_moe_diag(rec)`` runs ``scripts/chip_torch_tpu.py``'s ``generate:CASE=moe`` case (the same tiny model, the
same prompts drawn in the same order, float32 at "highest", 32 greedy new tokens, batch 1 and 4) and records, through
``rec(**fields)``:

- ``step="forms"``: the experts form hf_tpu's measured choice answers per graph (``traced``: each (tokens, form) the
  choice was asked for while the graphs were traced, i.e. per bucket: prefill ``batch x 16`` tokens, decode
  ``batch``) and the model's ``_experts_implementation``;
- ``step="generate"``: equal or not, and per row the first differing new-token index;
- ``step="logits"`` for each differing row: at that step, the CPU's and the TPU's top-2 tokens and margins from a
  plain eager forward of each model over the CPU's prefix, the logits' max abs difference there, and
  ``tie = cpu margin <= that difference`` (a tie explains the difference only when true); and the TPU's margin in its
  own decode graph (``generate(output_logits=True)`` at batch 4: up to the first difference its prefix is the CPU's);
- ``step="precision"``: each experts form on one experts layer (4 and 64 tokens, eager on the device) against a
  float64 loop, max error / max value (float32 should be ~1e-7; one bfloat16 pass is ~2e-3); on a chip also JAX's
  megablox ``gmm`` without a precision (the kernel's megablox form before the fix of issue #67);
- ``step="forced"``: the batch-4 generate with each experts form forced in every graph, equal or not per form, so
  one run tells which form is wrong.

Each sub-run is wrapped (an error is recorded and the stage goes on); ``DIAG_BUDGET_S`` (default 150) bounds the
whole stage: what would start past it is recorded as skipped. ``DIAG_FORMS`` (comma separated) narrows the forced
forms. On the simulator (``HF_TPU_SIMULATE=1``; it keeps transformers' default experts, so the stage forces hf_tpu's
measured choice, ``hf_tpu_measured_kernels``, with the kernel's Pallas forms in interpret mode) it runs as is::

    HF_TPU_SIMULATE=1 python scripts/chip_moe_diag.py [out.jsonl]      # the simulator (no time budget by default)
    python scripts/chip_moe_diag.py out.jsonl                          # a TPU VM with torch_tpu (real mode)

or from another stage runner: ``from scripts.chip_moe_diag import stage_moe_diag; stage_moe_diag(rec)``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN = 12
NEW_TOKENS = 32
#: forms forced at batch 4, the most telling first (the budget may stop the list): the Hub kernel's
#: (``kernel:<implementation>``), hf_tpu's torch forms, transformers'
FORCED = ("kernel:megablox", "kernel:pallas_decode", "grouped_mm", "hf_tpu_dense", "kernel:pallas", "kernel:dense",
          "hf_tpu_slots", "batched_mm", "eager")  # fmt: skip


def _tiny_moe(path: str) -> str:
    """``scripts/chip_torch_tpu.py``'s ``_tiny_model("moe", path)``: hf_tpu.testing's tiny Qwen3-MoE at lane-friendly
    sizes, weights x4, saved (copied here so that this stage does not import that script)."""
    import torch

    from hf_tpu.testing import tiny_model

    sizes = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, head_dim=64, max_position_embeddings=512,
                 moe_intermediate_size=256)  # fmt: skip
    model = tiny_model("qwen3_moe", **sizes)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path)
    return path


def _top2(logits) -> dict:
    values, index = logits.double().topk(2)
    return {"top1": int(index[0]), "top2": int(index[1]), "margin": float(values[0] - values[1])}


def _first_diffs(got, want) -> list:
    """Per row, the first new-token index where ``got`` differs from ``want`` (None: equal)."""
    out = []
    for r in range(want.shape[0]):
        a, b = got[r, PROMPT_LEN:].tolist(), want[r, PROMPT_LEN:].tolist()
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        out.append(diff)
    return out


class _Choices:
    """Logs each (tokens, form) hf_tpu's measured choice answers: ``experts_forms._CONSTANT_CHOICE`` swapped for an
    ``assume_constant_result`` wrapper that records and answers the same, so a compiled graph logs its form once,
    while it is traced (the answer is a constant of the graph)."""

    def __init__(self):
        import torch

        from hf_tpu.kernels import experts_forms

        self.log: list[tuple[int, str]] = []
        self._ef = experts_forms
        experts_forms._constant_choice_wrapper()
        self._previous = experts_forms._CONSTANT_CHOICE

        def choice(hidden, intermediate, experts, top_k, tokens, forms):
            form = experts_forms._choice(hidden, intermediate, experts, top_k, tokens, forms)
            self.log.append((tokens, form))
            return form

        experts_forms._CONSTANT_CHOICE = torch.compiler.assume_constant_result(choice)

    def take(self) -> list:
        seen = sorted(set(self.log))
        self.log.clear()
        return [list(x) for x in seen]

    def close(self):
        self._ef._CONSTANT_CHOICE = self._previous


def _kernel_forward(implementation: str, real: bool):
    """The Hub kernel's experts forward for ``implementation`` (its Pallas forms interpreted off a chip)."""
    from hf_tpu.kernels.loader import load_ragged_dot_kernel

    if not real and implementation in ("pallas", "pallas_decode", "megablox"):
        implementation += "_interpret"
    return load_ragged_dot_kernel().make_experts_forward(implementation)


def _experts_name(form: str, real: bool) -> str:
    """The ``experts_implementation`` name that runs ``form`` in every graph (registered here when needed)."""
    from hf_tpu.kernels import experts_forms
    from hf_tpu.kernels.registry import register_experts

    if form.startswith("kernel:"):
        name = "moe_diag_" + form.split(":", 1)[1]
        register_experts(name, _kernel_forward(form.split(":", 1)[1], real), replace=True)
        return name
    if form.startswith("hf_tpu_"):
        experts_forms.use_measured_experts()  # registers hf_tpu_dense / hf_tpu_slots
    return form


def _prompts(batch: int):
    """``stage_generate``'s prompts: ``torch.manual_seed(1)`` once, then batch 1's and batch 4's drawn in turn (loading
    and the CPU's greedy generate draw nothing from the generator: checked on the CPU)."""
    import torch

    torch.manual_seed(1)
    ids = {b: torch.randint(3, 1000, (b, PROMPT_LEN)) for b in (1, 4)}
    return ids[batch]


def stage_moe_diag(rec) -> None:
    """The diagnosis of issue #67 (see the module docstring); ``rec(**fields)`` appends one JSON record."""
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    import torch

    import hf_tpu

    start = time.monotonic()
    mode = hf_tpu.runtime.detect().mode
    real = mode == "real"
    budget = float(os.environ.get("DIAG_BUDGET_S", "150" if real else "100000"))

    def left() -> float:
        return budget - (time.monotonic() - start)

    def guarded(what: str, fn, *, needs: float = 5.0, **fields):
        if left() < needs:
            rec(step=what, skipped=f"no time left ({left():.0f} s of {budget:.0f})", **fields)
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - recorded, the stage goes on
            rec(step=what, error=repr(exc)[:1500], traceback=traceback.format_exc()[-2500:], **fields)
            return None

    torch.set_float32_matmul_precision("highest")
    hf_tpu.enable("generation")
    from transformers import AutoModelForCausalLM

    from hf_tpu.kernels import experts_forms

    rec(step="runtime", mode=mode, precision=torch.get_float32_matmul_precision(), budget_s=budget,
        measured_name=experts_forms.measured_name())  # fmt: skip
    path = _tiny_moe("/tmp/hf_tpu_chip_tiny_moe_diag")
    default_kwargs = {}
    if not real:
        # the simulator keeps transformers' default experts (prefer_measured acts on a chip only): force the chip's
        # default choice, its kernel forms interpreted
        experts_forms._KERNEL_FORWARDS.update(
            {form: _kernel_forward(impl, real) for form, impl in experts_forms.KERNEL_FORMS.items()}
        )
        experts_forms.use_measured_experts(experts_forms.MEASURED_KERNELS_NAME)
        default_kwargs["experts_implementation"] = experts_forms.MEASURED_KERNELS_NAME
    choices = _Choices()
    gen = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    cpu = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = cpu.config
    layer = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok)
    wants = {}
    try:
        for batch in (1, 4):
            ids = _prompts(batch)
            mask = torch.ones_like(ids)
            with torch.no_grad():
                want = cpu.generate(input_ids=ids, attention_mask=mask, **gen)
            wants[batch] = (ids, want)

            def run_default(batch=batch, ids=ids, mask=mask, want=want):
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **default_kwargs).to("tpu")
                t0 = time.perf_counter()
                with torch.no_grad():
                    got = model.generate(input_ids=ids, attention_mask=mask, **gen).cpu()
                first_s = time.perf_counter() - t0
                again = None
                if batch == 4:  # stage_generate compares its second call: the same graphs, warm
                    with torch.no_grad():
                        again = model.generate(input_ids=ids, attention_mask=mask, **gen).cpu()
                impl = getattr(model.config, "_experts_implementation", None)
                traced = choices.take()
                expected = {}
                if impl in (experts_forms.MEASURED_NAME, experts_forms.MEASURED_KERNELS_NAME):
                    forms = experts_forms.FORMS if impl == experts_forms.MEASURED_KERNELS_NAME else \
                        experts_forms.DEFAULT_FORMS  # fmt: skip
                    for tokens in sorted({t for t, _ in traced} | {batch}):
                        expected[tokens] = experts_forms.choose(*layer, tokens, forms=forms)
                rec(step="forms", batch=batch, experts=impl, traced=traced, chosen_per_tokens=expected)
                diffs = _first_diffs(got, want)
                equal = bool(got.shape == want.shape and (got == want).all())
                rec(step="generate", batch=batch, equal=equal, first_diff=diffs, first_s=round(first_s, 2),
                    second_equal_first=None if again is None else bool(torch.equal(again, got)),
                    second_equal_cpu=None if again is None else bool(again.shape == want.shape and
                                                                     (again == want).all()))  # fmt: skip
                return model, got, diffs

            result = guarded("generate", run_default, needs=20, batch=batch)
            if result is None:
                continue
            model, got, diffs = result
            for row, step in enumerate(diffs):
                if step is None:
                    continue

                def logits_at(row=row, step=step, model=model, got=got, want=want, batch=batch):
                    prefix = want[row : row + 1, : PROMPT_LEN + step]
                    with torch.no_grad():
                        cpu_logits = cpu(input_ids=prefix).logits[0, -1]
                        tpu_logits = model(input_ids=prefix.to("tpu")).logits[0, -1].cpu()
                    diff = float((cpu_logits - tpu_logits).abs().max())
                    c, t = _top2(cpu_logits), _top2(tpu_logits)
                    rec(step="logits", batch=batch, row=row, new_token_index=step, prefix_len=prefix.shape[1],
                        cpu_token=int(want[row, PROMPT_LEN + step]), tpu_token=int(got[row, PROMPT_LEN + step]),
                        cpu=c, tpu_eager=t, logits_max_abs_diff=diff, tie=c["margin"] <= diff,
                        experts_tokens_eager=prefix.shape[1],
                        eager_form=choices.take())  # fmt: skip

                guarded("logits", logits_at, needs=10, batch=batch, row=row)

            if batch == 4 and any(d is not None for d in diffs):

                def graph_logits(model=model, ids=ids, mask=mask, want=want, diffs=diffs):
                    with torch.no_grad():
                        out = model.generate(input_ids=ids, attention_mask=mask, output_logits=True,
                                             return_dict_in_generate=True, **gen)  # fmt: skip
                    seq = out.sequences.cpu()
                    rows = []
                    for row, step in enumerate(diffs):
                        if step is not None and step < len(out.logits):
                            rows.append({"row": row, "new_token_index": step,
                                         "tpu_graph": _top2(out.logits[step][row].cpu())})  # fmt: skip
                    rec(step="graph_logits", batch=4, rows=rows, first_diff=_first_diffs(seq, want),
                        forms=choices.take())  # fmt: skip

                guarded("graph_logits", graph_logits, needs=20)
            del model

        guarded("precision", lambda: _precision(rec, cpu, real), needs=15)

        if 4 in wants:
            ids, want = wants[4]
            mask = torch.ones_like(ids)
            forced = [f.strip() for f in os.environ.get("DIAG_FORMS", ",".join(FORCED)).split(",") if f.strip()]
            for form in forced:

                def run_forced(form=form):
                    name = _experts_name(form, real)
                    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                 experts_implementation=name)  # fmt: skip
                    model._hf_tpu_keep_experts = True  # hf_tpu's generate keeps it (see experts_forms.KEEP)
                    model = model.to("tpu")
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        got = model.generate(input_ids=ids, attention_mask=mask, **gen).cpu()
                    rec(step="forced", batch=4, form=form, experts=model.config._experts_implementation,
                        equal=bool(got.shape == want.shape and (got == want).all()),
                        first_diff=_first_diffs(got, want), seconds=round(time.perf_counter() - t0, 2),
                        traced=choices.take())  # fmt: skip

                guarded("forced", run_forced, needs=15, form=form)
    finally:
        choices.close()
    rec(step="moe_diag_done", seconds=round(time.monotonic() - start, 1))


def _precision(rec, cpu, real: bool) -> None:
    """Each experts form on layer 0's experts (4 and 64 tokens, a random routing with tokens sharing experts and
    empty experts at 4 tokens), eager on the device, against a float64 loop: max |error| / max |reference|."""
    import torch

    from hf_tpu.kernels import experts_forms

    module = cpu.model.layers[0].mlp.experts
    device_module = type(module)(cpu.config)
    device_module.load_state_dict(module.state_dict())
    device_module = device_module.to("tpu").eval()
    gate_up, down = module.gate_up_proj.detach().double(), module.down_proj.detach().double()
    g = torch.Generator().manual_seed(0)
    impls = ("megablox", "pallas_decode", "pallas", "dense")
    forms = {"kernel:" + impl: _kernel_forward(impl, real) for impl in impls}
    forms["hf_tpu_dense"] = experts_forms.dense_experts_forward
    forms["hf_tpu_slots"] = experts_forms.slots_experts_forward
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    forms["grouped_mm"] = ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    if real:
        old = _megablox_default_precision_forward()
        if old is not None:
            forms["gmm_default_precision"] = old
    for tokens in (4, 64):
        hidden = torch.randn(tokens, cpu.config.hidden_size, generator=g) * 4
        index = torch.randint(0, cpu.config.num_experts, (tokens, cpu.config.num_experts_per_tok), generator=g)
        index[0] = index[0, 0]  # both slots of one token to one expert
        weights = torch.rand(tokens, index.shape[1], generator=g)
        ref = torch.zeros(tokens, hidden.shape[1], dtype=torch.float64)
        for t in range(tokens):
            for j in range(index.shape[1]):
                e = int(index[t, j])
                gate, up = (gate_up[e] @ hidden[t].double()).chunk(2)
                ref[t] += float(weights[t, j]) * (down[e] @ (torch.nn.functional.silu(gate) * up))
        scale = float(ref.abs().max())
        errors = {}
        for name, fn in forms.items():
            try:
                with torch.no_grad():
                    out = fn(device_module, hidden.to("tpu"), index.to("tpu"), weights.to("tpu")).cpu()
                errors[name] = float((out.double() - ref).abs().max()) / scale
            except Exception as exc:  # noqa: BLE001
                errors[name] = repr(exc)[:300]
        rec(step="precision", tokens=tokens, rel_error=errors)


def _megablox_default_precision_forward():
    """On a chip: the experts layer with JAX's megablox ``gmm`` at Mosaic's default precision (no precision given, as
    the kernel's megablox form was before issue #67's fix), through TorchTPU's ``jax_op``; None where that fails."""
    import torch

    try:
        import jax
        import jax.numpy as jnp
        from jax.experimental.pallas.ops.tpu.megablox import gmm

        def grouped(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
            m = lhs.shape[0]
            tm = min(128, -(-m // 8) * 8)
            mp = -(-m // tm) * tm
            lhs_p = jnp.pad(lhs, ((0, mp - m), (0, 0)))
            k, n = lhs.shape[1], rhs.shape[1]
            out = gmm(lhs_p, rhs, group_sizes, preferred_element_type=jnp.float32,
                      tiling=(tm, min(k, 1024), min(n, 512)), transpose_rhs=True)  # fmt: skip
            return out[:m].astype(lhs.dtype)

        # jax_op reads the annotations for the op's schema: real objects (this module's are strings)
        grouped.__annotations__ = {"lhs": jax.Array, "rhs": jax.Array, "group_sizes": jax.Array, "return": jax.Array}
        op = torch.tpu.pallas.jax_op("hf_tpu_moe_diag::gmm_default_precision", grouped)
    except Exception:  # noqa: BLE001
        return None

    def forward(self, hidden_states, top_k_index, top_k_weights):
        top_k = top_k_index.shape[-1]
        ids = top_k_index.reshape(-1)
        order = torch.argsort(ids, stable=True)
        sizes = torch.bincount(ids, minlength=self.num_experts).to(torch.int32)
        h = op(hidden_states[order // top_k], self.gate_up_proj, sizes)
        h = self._apply_gate(h)
        h = op(h, self.down_proj, sizes) * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(h).index_copy_(0, order, h)
        return out.view(-1, top_k, h.shape[-1]).sum(dim=1)

    return forward


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else None

    def rec(**fields) -> None:
        line = json.dumps({"stage": "moe_diag", **fields, "t": time.time()}, default=str)
        print(line, flush=True)
        if out is not None:
            with open(out, "a") as f:
                f.write(line + "\n")

    stage_moe_diag(rec)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
