"""``hf-tpu plan --train``'s engine: what one training step (forward with the loss, backward, AdamW) costs a TPU
device, from libtpu's compiler, and what each of N devices would hold with FSDP, by arithmetic on those figures.

:func:`plan_train` builds the causal LM from its config on the meta device (nothing read, no memory), traces one
step and lowers it through torch_tpu's real front end (:mod:`hf_tpu.tpu_compile._train`), and compiles the two
programs (``train-forward-backward``, ``optimizer-adamw``) for one device of the target with libtpu. What comes
from where:

- **from the compiler** (one device, the model unsharded): each program's argument, output and temporary bytes,
  FLOPs, bytes accessed and compile seconds. The forward-backward program's temporaries are the activations saved
  for the backward plus the workspace of both passes; its outputs are the gradients.
- **from arithmetic**: parameters, gradients and AdamW's two moments (numel x element size); and the whole FSDP
  column: parameters, gradients and optimizer state divided by N, the compiler's activations unchanged (each device
  runs its own batch), plus FSDP's transient unsharded copies (the largest FSDP unit's parameters twice: the one
  computing and the one prefetched; and its unsharded gradients once, before the reduce-scatter; the units as
  hf_tpu wraps them: each decoder layer, and the rest, embeddings and head, as the root). Parameters are counted with
  the model's buffers.
  torch_tpu 0.2.0's front end was not asked to lower the collectives (all-gather, reduce-scatter) of a sharded
  program, so libtpu never saw an FSDP program: the column is a projection, labelled as such.

Example:
    >>> from hf_tpu.tpu_compile.train_plan import plan_train                          # doctest: +SKIP
    >>> plan = plan_train("llama-8b-config/", "v6e-8", seq_len=2048, layers=2)      # doctest: +SKIP
    >>> print(plan.table())                                                          # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hf_tpu.errors import UserError
from hf_tpu.tpu_compile.plan import human
from hf_tpu.tpu_compile.programs import ProgramRecord, lower_and_compile
from hf_tpu.tpu_compile.targets import Target
from hf_tpu.tpu_compile.targets import target as find_target

__all__ = ["TrainPlan", "plan_train"]

TRAIN_ENTRY = "hf_tpu.tpu_compile._train:lower_train"


@dataclass
class TrainPlan:
    """A training-step plan (see the module doc); :meth:`to_dict` is ``--json``'s object."""

    target: Target
    model: str
    shards: int
    programs: list[ProgramRecord]
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def _program(self, name: str) -> ProgramRecord | None:
        found = [p for p in self.programs if p.name == name and p.compiled]
        return found[0] if found else None

    def memory(self) -> dict[str, Any]:
        """Per-device bytes: ``one_device`` (the model unsharded; the compiler's where it has them) and ``fsdp``
        (N-way FSDP, arithmetic), with ``source`` saying which figure came from where."""
        info, n = self.info, self.shards
        params, grads, optim = (int(info.get(k, 0)) for k in ("params_bytes", "grads_bytes", "optimizer_bytes"))
        fwbw, opt = self._program("train-forward-backward"), self._program("optimizer-adamw")
        activations = fwbw.temp_bytes if fwbw else None
        one: dict[str, Any] = {"params": params, "grads": grads, "optimizer_state": optim, "activations": activations}
        if fwbw and opt:
            # the step's peak: the forward-backward program's own (parameters, gradients out, temporaries) with the
            # optimizer state resident, or the optimizer program's (everything in, new values out)
            one["total"] = max(fwbw.peak_bytes + optim, opt.peak_bytes)
            one["compiler_fwbw_peak"] = fwbw.peak_bytes
            one["compiler_optimizer_peak"] = opt.peak_bytes
            one["compiler_gradients_out"] = fwbw.output_bytes
        layer = int(info.get("largest_layer_bytes", 0))
        gathered = 0 if n == 1 else 3 * layer  # two layers' parameters unsharded (computing, prefetched) + grads
        fsdp: dict[str, Any] = {
            "params": params // n, "grads": grads // n, "optimizer_state": optim // n, "activations": activations,
            "fsdp_gathered": gathered,
        }  # fmt: skip
        if activations is not None:
            fsdp["total"] = fsdp["params"] + fsdp["grads"] + fsdp["optimizer_state"] + activations + gathered
        return {
            "one_device": one,
            "fsdp": fsdp,
            "shards": n,
            "source": {
                "compiler": "activations (the forward-backward program's temporaries: saved activations and the "
                "passes' workspace), compiler_* peaks, one_device.total",
                "arithmetic": "params, grads, optimizer_state (numel x element size), and every fsdp figure but "
                "activations (divided by N; fsdp_gathered = the largest FSDP unit's parameters x2 and gradients x1)",
            },
        }

    def fits(self) -> dict[str, bool | None]:
        mem, cap = self.memory(), self.target.hbm_bytes
        one, sharded = mem["one_device"].get("total"), mem["fsdp"].get("total")
        return {"one_device": None if one is None else one <= cap, "fsdp": None if sharded is None else sharded <= cap}

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "train",
            "target": self.target.name,
            "model": self.model,
            "shards": self.shards,
            "capacity": self.target.hbm_bytes,
            "memory": self.memory(),
            "fits": self.fits(),
            "programs": [p.to_dict() for p in self.programs],
            "info": self.info,
            "error": self.error,
        }

    def table(self) -> str:
        """The plan as a few lines of text (what ``hf-tpu plan --train`` prints)."""
        info, mem, n = self.info, self.memory(), self.shards
        one, fsdp = mem["one_device"], mem["fsdp"]

        def cell(value) -> str:
            return "-" if value is None else human(value)

        layers = f", first {info.get('layers')} layers" if info.get("layers_limited") else ""
        lines = [
            f"{self.model}: {info.get('model_type', '?')}, {info.get('parameters', 0) / 1e9:.3g}B parameters{layers}, "
            f"{info.get('dtype', '?')} parameters, gradients and AdamW state, {info.get('compute_dtype', '?')} compute; "
            f"batch {info.get('batch')} x "
            f"{info.get('seq_len')} tokens per device",
            f"target {self.target.describe()}",
            "",
            f"HBM per device ({human(self.target.hbm_bytes)})   {'one device, unsharded':>24}   "
            f"{f'FSDP over {n}':>14}   source",
            f"  parameters              {cell(one['params']):>24}   {cell(fsdp['params']):>14}   arithmetic",
            f"  gradients               {cell(one['grads']):>24}   {cell(fsdp['grads']):>14}   arithmetic"
            + (f" (compiler: {human(one['compiler_gradients_out'])} out)" if "compiler_gradients_out" in one else ""),
            f"  optimizer state (AdamW) {cell(one['optimizer_state']):>24}   {cell(fsdp['optimizer_state']):>14}   "
            "arithmetic",
            f"  activations + workspace {cell(one['activations']):>24}   {cell(fsdp['activations']):>14}   compiler",
            f"  FSDP unsharded unit     {'':>24}   {cell(fsdp['fsdp_gathered']):>14}   arithmetic",
            f"  total                   {cell(one.get('total')):>24}   {cell(fsdp.get('total')):>14}   "
            "compiler (one device) / arithmetic (FSDP)",
        ]
        fits = self.fits()
        if fits["one_device"] is not None:
            lines.append(
                f"  fits: one device {'yes' if fits['one_device'] else 'NO'}; FSDP over {n} "
                f"{'yes' if fits['fsdp'] else 'NO'}"
            )
        if self.programs:
            lines += ["", f"{'program':<24}{'lowered':>9}{'compiled':>10}{'lower s':>9}{'compile s':>11}"
                          f"{'GFLOP':>13}{'temp MB':>10}"]  # fmt: skip
            for p in self.programs:
                lines.append(
                    f"{p.name:<24}{'yes' if p.lowered else 'NO':>9}{'yes' if p.compiled else 'NO':>10}"
                    f" {(p.lower_seconds or 0):>8.1f} {(p.compile_seconds or 0):>10.1f}"
                    f" {(p.flops or 0) / 1e9:>12.3f} {(p.temp_bytes or 0) / 1e6:>9.1f}"
                )
                if p.error:
                    lines.append(f"    {p.error.splitlines()[0][:200]}" + (f"  [{p.where}]" if p.where else ""))
            total = sum((p.lower_seconds or 0) + (p.compile_seconds or 0) for p in self.programs)
            lines.append(
                f"compile time: tracing {info.get('trace_seconds', 0):.1f} s + lowering and libtpu {total:.1f} s here"
            )
        lines += [
            "",
            "The FSDP column is arithmetic on the compiler's one-device figures: libtpu compiled no sharded program "
            "(collectives not lowered).",
        ]
        fwbw = self._program("train-forward-backward")
        if fwbw is not None and fwbw.custom_calls == 0:
            lines.append(
                "Attention is lowered on its math path (the meta-device trace decomposes sdpa, so torch_tpu's flash "
                "kernel is not used): the activations include the attention matrices, an upper bound for a chip."
            )
        if self.error:
            lines += ["", f"error: {self.error}"]
        return "\n".join(lines)


def plan_train(
    model: str | os.PathLike,
    target: str = "v6e-8",
    *,
    batch: int = 1,
    seq_len: int = 2048,
    dtype: str = "bfloat16",
    layers: int | None = None,
    shards: int | None = None,
    compute_dtype: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> TrainPlan:
    """Plan one training step of ``model`` per device of ``target`` (see the module doc).

    Args:
        model: a model directory or its ``config.json`` (no weights are read).
        target: a name of :data:`hf_tpu.tpu_compile.TARGETS`; its device count is the FSDP degree unless ``shards``.
        batch, seq_len: each device's batch of token sequences.
        dtype: parameters, gradients and AdamW state.
        compute_dtype: the dtype the forward and backward compute in (the weights cast to it, as FSDP2's
            ``MixedPrecisionPolicy(param_dtype=...)``); None: ``dtype``.
        layers: plan only the first ``layers`` decoder layers (same width), for a model whose full step would take
            too long to compile here; the figures are then that slice's.
        shards: the FSDP degree (default: the target's device count).
        progress: called with a line of progress as programs lower and compile.

    Returns:
        A :class:`TrainPlan`.

    Raises:
        UserError: ``model`` has no config.json, or a size is not positive.
        hf_tpu.tpu_compile.UnknownTargetError: ``target`` is not a known target.
    """
    path = os.fspath(model)
    config_file = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise UserError(f"{path}: no config.json there; pass a model directory (save_pretrained) or its config.json")
    if min(batch, seq_len, layers or 1, shards or 1) < 1:
        raise UserError("batch, seq_len, layers and shards must be positive")
    chosen = find_target(target)
    n = shards or chosen.chips * chosen.devices_per_chip
    kwargs = {"model": path, "dtype": dtype, "batch": batch, "seq_len": seq_len, "layers": layers,
              "compute_dtype": compute_dtype}  # fmt: skip
    result = lower_and_compile(TRAIN_ENTRY, kwargs, chosen, progress=progress)
    info = dict(result.info)
    info["layers_limited"] = bool(layers)
    error = result.error
    if error is None and not any(p.compiled for p in result.programs):
        error = "no program compiled"
    return TrainPlan(chosen, path, n, result.programs, info, error)
