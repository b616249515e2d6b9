"""The new tokens kept on the device between read-backs: one copy back every K decode steps, not one per step.

A loop that reads each step's tokens back makes the host wait for the device once per token: the chip idles while
the copy lands, the host checks the tokens and dispatches the next step (measured on a v5e: 27% of a Llama-3.2-1B
decode step, docs/generation.md "Host waits"). Here the loop (:meth:`~.skeleton.LoopCall.run`) dispatches K steps
back to back, each fed from the last one's tokens on the device, and reads the K new tokens back in one copy
(:class:`DeviceRows`); the host then replays upstream's per-token bookkeeping over them, token by token (the
sequences, the streamer's ``put``, every stopping criterion), and cuts at the first token where every row has
stopped. So the output is upstream's exactly:

* what each row gets: a row that ended keeps its padding on the device, as upstream's ``unfinished_sequences`` does
  on the host: a flag per row lives on the device, the end-of-sequence ids (``EosTokenCriteria``) clear it, and it
  gates the token returned (the pad id) and the token fed to the next step (:func:`~hf_tpu.transformers.shapes.
  fill_id`);
* the other stopping criteria (``max_length``, ``stop_strings``, a caller's own ``StoppingCriteria``) run on the host
  at the read-back, once per token in order, as they run in upstream's loop; a row they stop is padded in the
  sequences at once, and its flag on the device is cleared at that read-back (until then its own tokens feed the
  next steps: rows do not see each other, so no other row's tokens change);
* the steps after the token where every row stopped are the price: at most K - 1 + :data:`READ_AHEAD` decode steps
  whose tokens are thrown away (:class:`ReadBacks` counts them; ``READ_AHEAD`` steps of the next window are
  dispatched before each read-back waits, so the chip is not idle while the host reads), and the device generator
  of a sampling call advances by their draws too (a call seeded with ``torch.manual_seed`` draws as before: the
  extra steps come after its last token). ``max_new_tokens`` costs none: no step is dispatched past it.

K is the model's ``read_back_every`` setting (:func:`hf_tpu.transformers.configure`, default
:data:`~hf_tpu.transformers._settings.READ_BACK_EVERY`). A call reads back each step (K = 1) where the host needs each
step's values anyway, and its route says why (``Route.read_back``, decided with the route by
:mod:`hf_tpu.transformers.route`; the loop adds the host path, :func:`~.skeleton.read_back`; both in
:func:`hf_tpu.transformers.explain`'s ``step_by_step``): the host path of the logits processors (the logits row comes
back each step), ``output_attentions``/``output_hidden_states`` (they come back each step), and ``max_time`` (its
criterion reads the clock, which a read-back K steps later would read too late). A streamer (``streamer=``) gets
every token through its own ``put`` call, as upstream's, at the read-back: the first token right after the prefill
(the first read-back holds that token alone, so the time to the first token does not grow), then K at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["READ_AHEAD", "DeviceRows", "ReadBacks", "read_backs"]

#: Decode steps of the next window dispatched before a read-back waits (the window's tokens are stacked on the device
#: first): the chip runs them while the host reads and turns the tokens over, instead of idling until the host
#: dispatches again. They count among the extra steps when every row stops in the window read.
READ_AHEAD = 4


@dataclass
class ReadBacks:
    """What one ``generate`` call's loop did (:func:`read_backs`).

    Attributes:
        every: the decode steps between two read-backs (1: each step).
        reason: why the call read back each step (None: every ``every`` steps).
        decode_steps: decode graphs run.
        read_backs: copies of new tokens back to the host.
        extra_steps: decode steps run after the token where every row stopped (their tokens are not returned);
            at most ``every - 1 + READ_AHEAD``.
    """

    every: int
    reason: str | None = None
    decode_steps: int = 0
    read_backs: int = 0
    extra_steps: int = 0


# The open read_backs() blocks: each one's list of the calls' records.
RECORDS: list[list[ReadBacks]] = []


@contextlib.contextmanager
def read_backs() -> Iterator[list[ReadBacks]]:
    """Record, while the block runs, what each ``generate`` call's loop read back (one :class:`ReadBacks` per call
    of hf_tpu's cached loop or its loop without a cache).

    Yields:
        The list the calls' records are appended to.

    Example:
        >>> with read_backs() as calls:                                   # doctest: +SKIP
        ...     model.generate(ids, max_new_tokens=32)
        >>> calls[0].read_backs, calls[0].decode_steps                    # doctest: +SKIP
        (4, 31)
    """
    records: list[ReadBacks] = []
    RECORDS.append(records)
    try:
        yield records
    finally:
        RECORDS.remove(records)


def eos_ids(stopping_criteria):
    """The end-of-sequence ids the device checks (upstream's ``EosTokenCriteria``'s), or None."""
    import torch
    from transformers.generation.stopping_criteria import EosTokenCriteria

    found = [c.eos_token_id.reshape(-1) for c in stopping_criteria if isinstance(c, EosTokenCriteria)]
    return torch.cat(found).to("cpu").long() if found else None


class DeviceRows:
    """The new tokens of a call between two read-backs, on the device, and the rows' flags there.

    :meth:`add` takes a graph's next tokens ``(batch,)`` and keeps what the sequences get (the pad id where a row has
    ended); :attr:`fed` is what the next decode step gets (the fill id there); :meth:`read` copies the kept tokens
    back in one copy of ``(every, batch)`` (one shape per batch size: warm-up compiles it); :meth:`sync` hands the
    device the host's flags after the host's stopping criteria ran.
    """

    def __init__(self, device, batch: int, every: int, pad: int | None, fill: int, eos) -> None:
        import torch

        self.device, self.every = device, every
        self.pad, self.fill = pad, fill
        self.eos = eos  # (n,) on the host, or None: no row ends on the device
        self.eos_dev = None if eos is None or pad is None else eos.to(device)
        self.unfinished = None
        if self.eos_dev is not None:
            self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.mirror = torch.ones(batch, dtype=torch.bool)  # the device's flags as the host knows them
        self.kept: list = []
        self.fed = None

    def add(self, tokens) -> None:
        import torch

        if self.unfinished is None:
            self.kept.append(tokens)
            self.fed = tokens
            return
        kept = torch.where(self.unfinished, tokens, self.pad)
        self.fed = torch.where(self.unfinished, tokens, self.fill)
        self.unfinished = self.unfinished & ~torch.isin(kept, self.eos_dev)
        self.kept.append(kept)

    def stage(self) -> tuple:
        """The kept tokens stacked on the device (one op, ``(every, batch)``), and a new window begun. :meth:`read`
        of the stack waits for its value only: steps dispatched after it can run while the host reads (on a v5e
        through torch_tpu, docs/generation.md "Host waits")."""
        import torch

        n = len(self.kept)
        block = torch.stack(self.kept + [self.kept[-1]] * (self.every - n))
        self.kept = []
        return block, n

    def read(self, staged: tuple | None = None):
        """The kept tokens on the host, ``(n, batch)`` (one copy back; of ``staged``, what :meth:`stage` returned, or
        of the tokens kept now), and the device's flags followed."""
        import torch

        block, n = staged if staged is not None else self.stage()
        block = block.to("cpu")[:n]
        if self.unfinished is not None:
            for row in block:
                self.mirror &= ~torch.isin(row, self.eos)
        return block

    def sync(self, unfinished) -> None:
        """Clear the device's flag of each row the host's stopping criteria ended (one small copy, only then): the
        tokens after the next one are fed and kept as the row's padding."""
        import torch

        if self.unfinished is None:
            return
        want = unfinished.bool()
        if not torch.equal(want, self.mirror):
            self.mirror = want.clone()
            # cleared, never set: steps dispatched ahead of the read-back may have ended rows on the device since
            self.unfinished = self.unfinished & want.to(self.device)
