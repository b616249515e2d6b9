"""Warm-up for the bucketed encoder forward: compile every (batch bucket, length bucket) graph ahead of the traffic.

After :func:`warmup`, a call whose batch fits a warmed batch bucket and whose length fits a warmed length bucket runs
on a graph that exists: 0 compiles. With ``strict=True`` (or ``HF_TPU_STRICT_COMPILE=1``) a call that would need
another graph raises :class:`~hf_tpu.encoders.EncoderRecompileError` naming it instead of compiling.

Example:
    >>> import hf_tpu.encoders                                                               # doctest: +SKIP
    >>> hf_tpu.encoders.warmup(model, max_length=128, batch_sizes=[1, 32])                   # doctest: +SKIP
    EncoderWarmupReport(graphs=[(1, 16), (1, 32), ...], new_compiles=10, ...)
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from hf_tpu.encoders._integration import MODEL_TYPES, serves
from hf_tpu.encoders._state import configure, state
from hf_tpu._shared.buckets import BucketLadder
from hf_tpu.errors import InvalidArgumentError

__all__ = ["EncoderWarmupReport", "warmup"]


@dataclass
class EncoderWarmupReport:
    """What :func:`warmup` did: the ``(batch bucket, length bucket)`` graphs it covered, how many it compiled (the
    others existed already), and how long it took.

    Attributes:
        graphs: the ``(batch bucket, length bucket)`` pairs run.
        new_compiles: graphs compiled during the warm-up (the others were compiled before).
        seconds: wall time of the warm-up.
        length_buckets: the length buckets covered.
        batch_buckets: the batch buckets covered.
    """

    graphs: list[tuple[int, int]] = field(default_factory=list)
    new_compiles: int = 0
    seconds: float = 0.0
    length_buckets: tuple[int, ...] = ()
    batch_buckets: tuple[int, ...] = ()

    def __str__(self) -> str:
        return (
            f"encoder warm-up: {len(self.graphs)} graphs ({self.new_compiles} newly compiled) for batch buckets "
            f"{list(self.batch_buckets)} and length buckets {list(self.length_buckets)} in {self.seconds:.1f}s"
        )


def warmup(
    model,
    max_length: int = 128,
    batch_sizes: Iterable[int] = (1,),
    *,
    output_hidden_states: bool = False,
    lengths: BucketLadder | Iterable[int] | None = None,
    strict: bool | None = None,
    progress: bool = True,
) -> EncoderWarmupReport:
    """Compile the encoder graph of every length bucket up to ``max_length`` for the buckets of ``batch_sizes``.

    The graphs are the ones inference calls use (``torch.no_grad`` or ``torch.inference_mode``: pipelines and
    sentence-transformers run there); a call with gradients on compiles graphs of its own.

    Args:
        model: an encoder (see :data:`hf_tpu.encoders.MODEL_TYPES`) on the TPU, in eval mode.
        max_length: every length bucket up to the one holding this many tokens is compiled.
        batch_sizes: batch sizes later calls use (each is rounded up to its batch bucket: 3 warms 4).
        output_hidden_states: warm the graphs that also return every layer's hidden states (what
            ``output_hidden_states=True`` calls use) instead.
        lengths: replaces the model's length ladder first (:func:`hf_tpu.encoders.configure`).
        strict: True: after warm-up, a call needing another graph raises instead of compiling.
        progress: show a progress bar.

    Returns:
        An :class:`EncoderWarmupReport`.

    Raises:
        hf_tpu.runtime.TPUNotAvailableError, ValueError (InvalidArgumentError): the model is not on the TPU (the
            message says how to place it), or ``batch_sizes`` holds no positive integer.
        hf_tpu.errors.UserError: the model's calls cannot take the bucketed path (the reason
            :func:`hf_tpu.encoders.explain` gives), so there is no graph to compile.
        hf_tpu._shared.buckets.BucketOverflowError: ``max_length`` or a batch size past the ladders.
    """
    import torch
    from tqdm.auto import tqdm

    from hf_tpu.encoders import forward, route
    from hf_tpu.errors import UserError

    if lengths is not None or strict is not None:
        configure(model, lengths=lengths, strict=strict)
    device = getattr(model, "device", None)
    if device is None or device.type not in forward.DEVICE_TYPES:
        from hf_tpu.runtime import require_tpu

        require_tpu("hf_tpu.encoders.warmup(model)")
        raise InvalidArgumentError(
            f"hf_tpu.encoders.warmup needs a model placed on the TPU, but it is on {device}: load it with "
            "device_map='tpu' or call model.to('tpu') first."
        )
    if not serves(model):
        model_type = getattr(model.config, "model_type", None)
        if model_type in MODEL_TYPES:
            fix = "turn on hf_tpu's encoders integration first: hf_tpu.enable() (or hf_tpu.enable('encoders'))"
        else:
            fix = f"the bucketed encoder forward serves {', '.join(MODEL_TYPES)} (hf_tpu.encoders.MODEL_TYPES)"
        raise UserError(
            f"hf_tpu.encoders.warmup: {type(model).__name__} ({model_type}) has no bucketed forward: {fix}"
        )
    found = state(model)
    sizes = tuple(dict.fromkeys(int(b) for b in batch_sizes))
    if not sizes or min(sizes) < 1:
        raise InvalidArgumentError(f"batch_sizes must hold positive integers, got {batch_sizes!r}")
    batch_buckets = tuple(dict.fromkeys(found.batch_sizes.bucket(b, "a warm-up batch size") for b in sizes))
    length_buckets = found.length_ladder(model.config).up_to(max_length)
    upstream = type(model).forward
    upstream = getattr(upstream, "__hf_tpu_upstream__", upstream)
    report = EncoderWarmupReport(length_buckets=length_buckets, batch_buckets=batch_buckets)
    before = len(found.compiled)
    start = time.perf_counter()
    was_warmed, found.warmed = found.warmed, False  # warm-up compiles what strict mode would refuse
    plans = [(b, n) for b in batch_buckets for n in length_buckets]
    bar = tqdm(plans, desc="hf_tpu encoder warm-up", unit="shape", disable=not progress)
    try:
        with torch.no_grad():
            for rows, length in bar:
                bar.set_postfix_str(f"batch {rows}, length {length}")
                ids = torch.ones(rows, length, dtype=torch.long)
                arguments = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
                if output_hidden_states:
                    arguments["output_hidden_states"] = True
                plan = route.decide(model, upstream, arguments)
                if not plan.bucketed:
                    raise UserError(f"hf_tpu.encoders.warmup: no graph to compile: {plan.reason}")
                try:
                    forward.run(model, upstream, plan)
                except (forward.Unpaddable, forward.NotOneGraph) as exc:
                    found.problem = forward.problem(model, exc)
                    raise UserError(f"hf_tpu.encoders.warmup: no graph to compile: {found.problem}") from exc
                report.graphs.append((rows, length))
    except BaseException:
        found.warmed = was_warmed
        raise
    finally:
        bar.close()
    found.warmed = True
    report.new_compiles = len(found.compiled) - before
    report.seconds = time.perf_counter() - start
    return report
