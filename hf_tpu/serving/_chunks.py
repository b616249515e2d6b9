"""Decode-only steps of the continuous-batching loop without a host wait per step: K steps, one read-back.

Upstream's loop (transformers 5.24, ``ContinuousBatchingManager._generation_loop_body``) runs one step at a time:
schedule on the host, copy the step's inputs to the device, run the step graph, read the step's tokens back
(``prepare_batch_update``: one device->host copy and one host wait per step), update the requests. On a ``tpu``
model hf_tpu's loop body (:func:`loop_body`) does the same for every step that admits a request or prefills, and
for the *decode-only* steps (every active request in the step, one token each, already decoding, none to fork, none
arriving in the manager's input queue) it runs a chunk of up to K steps (:func:`run_chunk`). Requests waiting that
this step's scheduling could not admit (no slot, no room in the cache) do not stop a chunk: it then ends at the first
request to reach its ``max_new_tokens``, the step where upstream's loop would free its slot.

* step 1 is the step upstream's scheduler just prepared; before each of steps 2..K the host allocates each
  request's KV block for its next token (``PagedAttentionCache.can_store_request_tokens``) and prepares the step's
  positions, read/write indices and sampling rows with upstream's ``prepare_batch_tensors`` (on the host, sent in
  the step's one host->device copy: :mod:`~hf_tpu.serving._staging`; no wait), and the step's input ids are the
  previous step's output ids, which the step graph takes from ``output_ids`` on the device
  (:func:`~hf_tpu.serving._staging.feed_previous`);
* each step's tokens are kept on the device (a copy of row 0 of ``output_ids`` into a buffer of one shape per
  manager, :func:`_buffer`) and come back after the chunk in one device->host copy;
* the host then replays upstream's update (``update_batch``) step by step, request by request:
  ``update_and_check_completion``, ``mark_complete_blocks``, ``finish_request`` (which frees the request's blocks)
  and the delivery of the step's outputs; a request that ended mid-chunk drops the tokens of its later steps
  (counted as ``extra_tokens``; at most K - 1 per request and chunk).

K is ``hf_tpu.serving.configure(read_back_every=K)`` (default 8; 1: a read-back each step, upstream's loop), read
when a manager is created. A chunk is also cut short, never wrong: at the largest number of new tokens any of its
requests may still produce, where a request under its ``min_tokens`` reaches it (its end-of-sequence mask changes
there), when a request arrives or a cancellation comes in (the manager's queues), when a request needs a KV block
the cache cannot give, or when the KV tokens read would pass the cache's step budget. Chunks are not run with the
manager's ``return_logprobs``, async batching, or under tensor parallelism: those steps take upstream's per-step
path. A request's own ``logprobs`` are kept: the chunk then keeps every output row of each step (tokens,
log-probabilities, alternatives) and reads them back in the same one copy.

No read-ahead (issue #69 asked for it): ``generate``'s loop dispatches ``READ_AHEAD`` steps of the next window
before it waits for a read-back (:mod:`hf_tpu.transformers._loops.readback`), so the device stays busy while the host
reads. Here the next chunk cannot be dispatched before the read-back: upstream's scheduler plans it from the state
the replay of this chunk leaves (requests finished, blocks freed, requests admitted), and running the scheduler on a
host state ahead of what it has delivered (positions, blocks, ``tokens_to_process`` advanced past unread tokens) is
not something upstream's ``update_batch`` expects. What could run ahead are more steps of the same requests, read
back in a second copy: that is a longer chunk, and a slot freed by an end-of-sequence would then reach a waiting
request up to ``READ_AHEAD`` steps later than now. That changes which requests share a step, and the step's numerics
(batch composition, padding rows) can pick the other of two near-tied tokens: on the tiny test model, 2 of 8 and 5
of 32 requests run together (48 greedy tokens each) already differ from CPU's one-request ``generate`` somewhere
(at 8 requests the same two with chunks or without). Not done, for that reason and for lack of a chip measurement
saying it is worth it: the host's work between two chunks is the replay and one scheduling step, no device op.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["ReadBacks", "loop_body", "read_backs", "run_chunk"]


@dataclass
class ReadBacks:
    """What a continuous-batching manager's loop did (see :func:`read_backs`).

    Attributes:
        every: K, the decode steps of a chunk.
        steps: every step the loop ran.
        chunked_steps: the steps run in chunks (no read-back of their own).
        chunks: the chunks (one read-back each).
        per_step_reads: the steps run one at a time (upstream's path: one read-back each).
        extra_tokens: tokens computed for a request after it ended in the same chunk, and dropped.
        reasons: why steps took the per-step path, by reason, counted.
    """

    every: int = 1
    steps: int = 0
    chunked_steps: int = 0
    chunks: int = 0
    per_step_reads: int = 0
    extra_tokens: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    @property
    def read_backs(self) -> int:
        """The device->host reads of step outputs: one per chunk and one per step taken one at a time."""
        return self.chunks + self.per_step_reads


# how long an idle loop sleeps before it looks for new requests again: upstream's poll interval, not a limit on work
_IDLE_POLL_S = 0.1

_LOCK = threading.Lock()


def read_backs(manager_or_model) -> ReadBacks:
    """What a continuous-batching manager's loop has done so far: its steps, chunks and read-backs.

    Args:
        manager_or_model: a continuous-batching manager, or a model whose ``generate_batch`` (with
            ``persistent_manager=True``) or ``init_continuous_batching`` made one.

    Returns:
        The manager's :class:`ReadBacks` (the live record, updated as the loop runs); a new, empty one when there is
        no manager on a ``tpu`` model or it has run no step yet.

    Example:
        >>> with model.continuous_batching_context_manager() as manager:               # doctest: +SKIP
        ...     ...
        >>> hf_tpu.serving.read_backs(manager).read_backs                              # doctest: +SKIP
    """
    manager = getattr(manager_or_model, "_cached_continuous_batching_manager", manager_or_model)
    record = getattr(manager, "_hf_tpu_read_backs", None)
    return record if record is not None else ReadBacks()


def _record(manager) -> ReadBacks:
    record = manager.__dict__.get("_hf_tpu_read_backs")
    if record is None:
        with _LOCK:
            record = manager.__dict__.setdefault("_hf_tpu_read_backs", ReadBacks(every=_every(manager)))
    return record


def _every(manager) -> int:
    return int(manager.__dict__.get("_hf_tpu_read_back_every", 1) or 1)


def _plan(manager, processor) -> tuple[str | None, int]:
    """``(None, most steps)`` when the step just prepared can start a chunk of at most that many steps, else
    ``(why not, 1)``. A request under its ``min_tokens`` caps the chunk where its end-of-sequence mask would change
    (the mask is prepared per step from the request's count on the host, which the chunk does not advance)."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    from hf_tpu.serving import _penalties, _sampling

    every = _every(manager)
    if every <= 1:
        return "read_back_every=1", 1
    sampler = processor.logit_processor
    if not isinstance(sampler, _sampling.RowSampling) or processor.use_async_batching:
        return "async batching", 1
    if getattr(manager.model, "_device_mesh", None) is not None:
        return "tensor parallel", 1
    if processor.return_logprobs:
        return "logprobs", 1
    scheduler = processor.scheduler
    futures = processor.inputs_and_outputs.requests_in_batch
    if any(f.state.logit_processor_kwargs.get("grammar") is not None for f in futures):
        return "structured output", 1  # each step's mask needs the step before's tokens on the host
    if processor.input_queue is not None and not processor.input_queue.empty():
        return "requests arriving", 1
    if scheduler._requests_to_fork or scheduler.starved_requests or len(futures) != len(scheduler.active_requests):
        return "not every request in the step", 1
    most = every
    if scheduler.waiting_requests:  # ones this step's scheduling could not admit: the chunk ends at the first
        # request to reach its max_new_tokens (its slot and blocks are free for them at the same step as without
        # chunks); one ending on its end-of-sequence id frees them at the chunk's end, up to K - 1 steps later
        most = max(1, min(f.state._new_tokens_limit - f.state.generated_len() for f in futures))
    for future in futures:
        state = future.state
        if not future.has_new_token or future.query_length != 1 or state.generated_len() == 0:
            return "prefill", 1
        if state.status != RequestStatus.DECODING:
            return "prefill", 1
        if _penalties.host_values(state, sampler.defaults)[3]:  # under min_tokens: so many more steps keep the mask
            minimum = int(state.logit_processor_kwargs.get("min_tokens", sampler.defaults["min_tokens"]))
            most = min(most, max(1, minimum - _penalties.generated_count(state)))
    return None, most


def loop_body(manager, processor, bootstrapping: bool, upstream) -> bool:
    """``ContinuousBatchingManager._generation_loop_body`` with chunks of decode-only steps (module docstring);
    upstream's body, unchanged, when the manager runs no chunks (K = 1) or bootstraps async batching."""
    if bootstrapping or _every(manager) <= 1:
        return upstream(manager, processor, bootstrapping)
    from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus

    if processor.prepare_next_batch():
        record = _record(manager)
        why, most = _plan(manager, processor)
        if why is None:
            run_chunk(manager, processor, record, most)
        else:
            manager._generation_step()
            manager.current_batch += 1
            processor.update_batch()
            record.steps += 1
            record.per_step_reads += 1
            record.reasons[why] = record.reasons.get(why, 0) + 1
        return True
    # the rest is upstream's body, as it is (transformers 5.24)
    status = manager.background_thread_status
    if status.tp_status == BackgroundThreadStatus.HARD_STOP:
        return False
    if status.tp_status == BackgroundThreadStatus.FLUSH_AND_STOP and not processor.has_pending_requests():
        return False
    manager._wake_up_loop.wait(timeout=_IDLE_POLL_S)
    manager._wake_up_loop.clear()
    return True


def _chunk_length(futures, every: int) -> int:
    """K, or fewer when no request of the chunk can produce K more tokens."""
    most = max(f.state._new_tokens_limit - f.state.generated_len() for f in futures)
    return max(1, min(every, most))


def _prepare_next(processor, futures) -> list | None:
    """Schedule the next decode step of the same requests, in the same order, on the host: each request's KV block
    for one more token and the step's tensors. None (and nothing prepared) when the cache cannot take the step."""
    from transformers.generation.continuous_batching.requests import FutureRequestState

    cache, io, runner = processor.cache, processor.inputs_and_outputs, processor.model_runner
    limit = cache.read_cache_limit
    kv = sum(f.state.current_len() if limit is None else min(f.state.current_len(), limit) for f in futures)
    if kv > cache.max_tokens_read:
        return None
    for f in futures:
        if not cache.can_store_request_tokens(f.state, 1):
            return None  # (blocks already given to others stay theirs, freed when they finish)
    following = [FutureRequestState(f.state, True, cache.count_new_complete_blocks(f.state, 1), 1) for f in futures]
    num_q, max_kv = runner.maybe_pad_inputs(len(following), kv, False)
    io.prepare_batch_tensors(
        requests_in_batch=following, logits_processors=processor.logit_processor, use_decode_fast_path=False,
        num_q_tokens=num_q, max_kv_read=max_kv, use_padding=runner.pad_inputs,
    )  # fmt: skip
    return following


def _news(processor) -> bool:
    """A request arrived or a cancellation came in (the chunk then ends after the step running: the scheduler
    admits or cancels at the next step, not K - 1 steps later)."""
    queues = (processor.input_queue, processor.cancel_queue)
    return any(q is not None and not q.empty() for q in queues)


def _buffer(io, every_row: bool, every: int):
    """The device buffer a chunk keeps its steps' outputs in: ``[K, rows of output_ids (all of them, or the tokens'
    only), columns of output_ids]``, one per IO object, so that the chunk's copies have one shape whatever its
    length and number of requests (no new eager signature)."""
    import torch

    key = "_hf_tpu_chunk_outputs" if every_row else "_hf_tpu_chunk_tokens"
    buffer = io.__dict__.get(key)
    if buffer is None or buffer.shape[0] < every:
        shape = (every, io.output_ids.shape[0] if every_row else 1, io.output_ids.shape[1])
        buffer = io.__dict__[key] = torch.zeros(shape, dtype=io.output_ids.dtype, device=io.output_ids.device)
    return buffer


def _dispatch(processor, model) -> None:
    """Upstream's ``ContinuousBatchProcessor._generation_step`` without its ``retrieve_device_outputs`` (a wait for
    the compute stream where the device has one): the step is queued on the device, nothing is waited for."""
    import torch

    io, runner = processor.inputs_and_outputs, processor.model_runner
    with torch.no_grad():
        runner.compute_batch(model, io.get_model_kwargs(use_padding=runner.pad_inputs))


def run_chunk(manager, processor, record: ReadBacks, most: int | None = None) -> None:
    """Run the decode step the scheduler prepared and up to K - 1 more of the same requests, read their tokens back
    in one copy, and replay upstream's per-token update (module docstring)."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    from hf_tpu.serving import _staging
    from hf_tpu.serving._sampling import logprob_records

    io = processor.inputs_and_outputs
    futures = list(io.requests_in_batch)
    rows = len(futures)
    wanted = [f.state.logit_processor_kwargs.get("logprobs") for f in futures]
    every_row = any(w is not None for w in wanted)  # the log-probability rows come back too
    length = _chunk_length(futures, record.every if most is None else min(most, record.every))
    kept = _buffer(io, every_row, record.every)
    steps, done = [futures], 0
    while True:
        _dispatch(processor, manager.model)
        manager.current_batch += 1
        kept[done].copy_(io.output_ids if every_row else io.output_ids[:1])  # the step's outputs, on the device
        done += 1
        if done == length or _news(processor):
            break
        following = _prepare_next(processor, futures)
        if following is None:
            break
        # the next input ids: this step's tokens, on the device (every column: past the requests' rows are the
        # padding rows, whose ids only feed padding rows); taken by the step graph from output_ids when staged
        if not _staging.feed_previous(io):
            io.input_ids.copy_(kept[done - 1, 0, : io.input_ids.shape[0]])
        steps.append(following)
    io.retrieve_device_outputs()  # (upstream's wait for its compute stream, once a chunk; none on one stream)
    read = kept[:done].tolist()  # the chunk's one device->host copy
    record.steps += done
    record.chunked_steps += done
    record.chunks += 1

    scheduler, cache, router = processor.scheduler, processor.cache, processor.output_router
    for step, table in zip(steps, read):
        table = [r[:rows] for r in table]
        pending = []
        records = logprob_records(table, wanted) if every_row else [None] * rows
        for future, token, logprob in zip(step, table[0], records):
            state = future.state
            if state.status == RequestStatus.FINISHED:  # ended earlier in this chunk: its later tokens are dropped
                record.extra_tokens += 1
                continue
            finished = state.update_and_check_completion(token, logprob)
            cache.mark_complete_blocks(state, future.complete_blocks)
            if finished:
                scheduler.finish_request(state.request_id)
                scheduler.block_new_requests = False
            if state.streaming or state.status == RequestStatus.FINISHED:
                pending.append(state.to_generation_output())
        if pending:
            router.deliver_batch(pending)
