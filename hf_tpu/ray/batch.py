"""Batch inference with Ray Data: :class:`HfTpuGenerate`, a callable class for ``Dataset.map_batches``.

Ray Data runs a callable class in a pool of actors (``compute=ray.data.ActorPoolStrategy(size=N)``; ``concurrency=N``,
deprecated since Ray 2.51): each actor builds the class once and calls it on batch after batch. Here each actor loads
the model once on its TPU (``device_map="tpu"``), warms up the graphs of one batch shape through :func:`hf_tpu.warmup`
with the persistent compile cache (:mod:`hf_tpu.compile_cache`), and then generates each batch with hf_tpu's bucketed
``generate`` (static cache, compiled prefill and decode).

* Warm-up holds a lock on the cache directory, so actors that start together on one host (or on hosts sharing the
  directory) warm up one after the other: the first compiles and stores, the later ones load (0 compiles).
* Every row comes back: a batch whose ``generate`` raises is generated again row by row, and a row that still fails
  (or a prompt longer than ``max_prompt_len``) carries the reason in its ``error`` column. An actor that dies
  (preempted host, killed process) is Ray Data's to handle: it restarts the actor and retries the batch (its
  defaults for actor pools: ``max_restarts=-1``, ``max_task_retries=-1``).
* A short batch (the dataset's last) is padded to ``batch_size`` with copies of its last prompt, so no call needs a
  graph warm-up did not compile; the copies' outputs are dropped.

Ray is not imported here (the class runs on a dict of numpy arrays, in or out of Ray); its runtime context only
names the node in :class:`StartReport`.

Example:
    >>> import ray                                                                                  # doctest: +SKIP
    >>> from hf_tpu.ray import HfTpuGenerate                                                        # doctest: +SKIP
    >>> ds = ray.data.read_json("prompts.jsonl")              # a "prompt" column                   # doctest: +SKIP
    >>> out = ds.map_batches(
    ...     HfTpuGenerate,
    ...     fn_constructor_kwargs={"model": "/models/llama", "batch_size": 16, "max_new_tokens": 64,
    ...                            "cache_dir": "/mnt/shared/hf_tpu_compile"},
    ...     batch_size=16, resources={"TPU": 1}, compute=ray.data.ActorPoolStrategy(size=8))  # doctest: +SKIP
    >>> out.write_parquet("/mnt/out")                                                               # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import socket
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hf_tpu.errors import UserError

__all__ = ["HfTpuGenerate", "StartReport"]

#: The lock file actors take in the compile-cache directory while they warm up.
WARMUP_LOCK = "ray-warmup"


@dataclass
class StartReport:
    """What one actor's start cost: loading the model, warming up, and how many graphs it compiled or loaded.

    Attributes:
        pid: the actor's process id.
        node_id: the Ray node it runs on (None outside Ray).
        hostname: the host's name.
        load_s: seconds to load the model on the TPU.
        warmup_s: seconds of warm-up, waiting for the cache lock included.
        lock_wait_s: seconds spent waiting for another actor's warm-up on the same cache directory.
        graphs: graphs the warm-up covered.
        new_compiles: graphs it compiled (0 when every graph came from the compile cache).
        from_cache: graphs it loaded from the compile cache.
        sim_compiles: compiles the simulated device counted during warm-up (None on a chip).
        cache_dir: the compile-cache directory (None without one).
        tpu_visible_chips: ``TPU_VISIBLE_CHIPS`` as Ray set it for this actor (None when unset).
    """

    pid: int
    node_id: str | None
    hostname: str
    load_s: float
    warmup_s: float
    lock_wait_s: float
    graphs: int
    new_compiles: int
    from_cache: int
    sim_compiles: int | None
    cache_dir: str | None
    tpu_visible_chips: str | None = field(default=None)


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - the report names the node when it can; nothing depends on it
        return None


# The integrations the live generators enabled, and how many live: the first one enables what was off, the last one
# to be collected disables that again (a count, not a scope: an actor's calls keep them on between batches, and
# turning them on and off around each call would cost every batch ~0.1 s of host time).
_HELD: dict[str, Any] = {"live": 0, "added": []}


def _hold_integrations(owner: object) -> weakref.finalize:
    from hf_tpu import _patch

    if _HELD["live"] == 0:
        before = {name for name in _patch.INTEGRATIONS if _patch.is_enabled(name)}
        _patch.enable()
        _HELD["added"] = [name for name in _patch.INTEGRATIONS if _patch.is_enabled(name) and name not in before]
    _HELD["live"] += 1
    return weakref.finalize(owner, _release_integrations)  # (called once: by close(), or when owner is collected)


def _release_integrations() -> None:
    from hf_tpu import _patch

    _HELD["live"] -= 1
    if _HELD["live"] == 0 and _HELD["added"]:
        still = [name for name in reversed(_HELD["added"]) if _patch.is_enabled(name)]
        _HELD["added"] = []
        if still:  # (disable() with no names would revert every integration)
            _patch.disable(*still)


class HfTpuGenerate:
    """Generate text for a batch of prompts on this actor's TPU (a callable class for ``Dataset.map_batches``).

    The constructor loads the model and warms up; each call takes a batch (a dict of numpy arrays, Ray Data's
    ``"numpy"`` batch format, its default) and returns it with three columns added: ``generated_text`` (str),
    ``generated_token_ids`` (the new tokens, up to and including the first end-of-sequence token) and ``error``
    (None, or why the row has no output). The input columns are kept.

    Greedy by default (``do_sample=False``): the rows equal the CPU's ``generate`` on the same prompts.
    Pass the same ``batch_size`` here and to ``map_batches``.

    hf_tpu's integrations (:func:`hf_tpu.enable`) are in force while a generator lives (in a Ray actor: the actor's
    life); when the last one is closed (:meth:`close`) or garbage-collected, those it enabled are disabled again,
    those the caller had enabled before stay (out of Ray, in a notebook or a test, the process is left as it was).

    Args:
        model: a model directory (``save_pretrained`` layout) or Hub id, loaded with ``device_map="tpu"``.
        tokenizer: the tokenizer's directory or id (default: ``model``).
        batch_size: rows per ``generate`` call; the one batch size warmed up.
        max_new_tokens: tokens generated per row.
        max_prompt_len: the longest prompt in tokens; warm-up covers every prompt bucket up to it, and a longer
            prompt's row gets an ``error`` instead of compiling a new graph.
        prompt_column: the column holding the prompts (strings).
        cache_dir: the persistent compile-cache directory (default: ``HF_TPU_COMPILE_CACHE``, else none). Point
            every actor at the same directory (a shared filesystem across hosts) and only the first compiles.
        dtype: the model's dtype (``"bfloat16"``, ...; default: the checkpoint's).
        tp_size: chips per model. Only 1 is built: run one actor per chip (``resources={"TPU": 1}``); for a model
            that needs tensor parallel, serve it with :mod:`hf_tpu.ray.serve` (``tp=N``) and send it the rows.
        simulate: enable the simulated ``tpu`` device in the actor (as ``HF_TPU_SIMULATE=1`` does; that variable in
            the job's ``runtime_env`` works as well).
        generate_kwargs: more arguments for ``generate`` (sampling: ``{"do_sample": True, "temperature": 0.7}``).
        start_reports: a directory where each actor writes its :class:`StartReport` as JSON (on a shared filesystem
            to collect them across hosts; default: none). The report is also :attr:`start_report`.

    Raises:
        UserError: ``tp_size`` is not 1, or ``batch_size``, ``max_new_tokens`` or ``max_prompt_len`` is not
            positive.

    Example:
        >>> gen = HfTpuGenerate(path, batch_size=2, max_new_tokens=4, max_prompt_len=16,
        ...                     simulate=True)                                                      # doctest: +SKIP
        >>> gen({"prompt": np.array(["The king said", "O Romeo"])})["generated_text"]             # doctest: +SKIP
    """

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        batch_size: int = 16,
        max_new_tokens: int = 32,
        max_prompt_len: int = 128,
        prompt_column: str = "prompt",
        cache_dir: str | os.PathLike | None = None,
        dtype: str | None = None,
        tp_size: int = 1,
        simulate: bool = False,
        generate_kwargs: dict[str, Any] | None = None,
        start_reports: str | os.PathLike | None = None,
    ) -> None:
        if tp_size != 1:
            raise UserError(
                f"HfTpuGenerate(tp_size={tp_size}): one actor runs one model on one chip (torch_tpu gives a process "
                "one chip). Run one actor per chip (map_batches(..., resources={'TPU': 1}, "
                "compute=ActorPoolStrategy(size=<chips>))), or serve the model with tensor parallel "
                f"(hf_tpu.ray.serve with tp={tp_size}) and send it the rows."
            )
        for name, value in (("batch_size", batch_size), ("max_new_tokens", max_new_tokens),
                            ("max_prompt_len", max_prompt_len)):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise UserError(f"HfTpuGenerate({name}={value!r}): pass a positive integer")
        if simulate:
            os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
            from hf_tpu import sim

            sim.enable()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from hf_tpu import runtime
        from hf_tpu.compile_cache import CompileCache

        info = runtime.require_tpu("HfTpuGenerate")
        self._release = _hold_integrations(self)
        self.batch_size, self.max_new_tokens, self.max_prompt_len = batch_size, max_new_tokens, max_prompt_len
        self.prompt_column = prompt_column
        self.generate_kwargs = {"do_sample": False, **(generate_kwargs or {})}
        start = time.perf_counter()
        load = {} if dtype is None else {"dtype": dtype}
        self.model = AutoModelForCausalLM.from_pretrained(model, device_map="tpu", **load).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        load_s = time.perf_counter() - start
        cache = CompileCache.coerce(cache_dir) or CompileCache.from_env()
        self.start_report = self._warm_up(cache, info.mode == "simulated", load_s)
        if start_reports is not None:
            folder = Path(start_reports)
            folder.mkdir(parents=True, exist_ok=True)
            name = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}.json"
            (folder / name).write_text(json.dumps(asdict(self.start_report)))

    def close(self) -> None:
        """Let go of hf_tpu's integrations now rather than when this generator is collected (a second call does
        nothing); the generator can still be called, with the integrations another live one holds, or none."""
        self._release()

    def _warm_up(self, cache, simulated: bool, load_s: float) -> StartReport:
        """Warm up the one batch shape, holding the cache directory's lock so that only the first actor compiles."""
        import contextlib

        from hf_tpu.compile_cache import exclusive
        from hf_tpu.transformers.warmup import warmup

        start = time.perf_counter()
        lock = contextlib.nullcontext() if cache is None else exclusive(cache.root / WARMUP_LOCK)
        counted = contextlib.nullcontext()
        if simulated:
            from hf_tpu import sim

            counted = sim.stats()
        with lock:
            waited = time.perf_counter() - start
            with counted as stats:
                report = warmup(self.model, max_prompt_len=self.max_prompt_len, batch_sizes=[self.batch_size],
                                max_new_tokens=self.max_new_tokens, progress=False, cache_dir=cache)  # fmt: skip
        return StartReport(
            pid=os.getpid(), node_id=_node_id(), hostname=socket.gethostname(), load_s=round(load_s, 3),
            warmup_s=round(time.perf_counter() - start, 3), lock_wait_s=round(waited, 3), graphs=len(report.graphs),
            new_compiles=report.new_compiles, from_cache=report.from_cache,
            sim_compiles=stats.compiles if simulated else None,
            cache_dir=None if cache is None else str(cache.root),
            tpu_visible_chips=os.environ.get("TPU_VISIBLE_CHIPS"),
        )  # fmt: skip

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Generate for every row of ``batch``.

        Args:
            batch: a dict of columns (numpy arrays or lists), one of them ``prompt_column`` (strings).

        Returns:
            ``batch`` with ``generated_text``, ``generated_token_ids`` and ``error`` added, one entry per row.

        Raises:
            UserError: ``batch`` has no ``prompt_column``.
        """
        import numpy as np

        if self.prompt_column not in batch:
            raise UserError(
                f"HfTpuGenerate: the batch has no column {self.prompt_column!r} (columns: {', '.join(batch)}); "
                "pass prompt_column=... naming the column of prompts"
            )
        prompts = [str(p) for p in batch[self.prompt_column]]
        encoded = [self.tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
        results: list[tuple[str, list[int], str | None]] = [("", [], None)] * len(prompts)
        fits = []
        for row, ids in enumerate(encoded):
            if not ids:
                results[row] = ("", [], "the prompt is empty after tokenization")
            elif len(ids) > self.max_prompt_len:
                results[row] = ("", [], f"the prompt is {len(ids)} tokens, longer than max_prompt_len="
                                        f"{self.max_prompt_len}: raise max_prompt_len (its graphs are warmed up too)")
            else:
                fits.append(row)
        for start in range(0, len(fits), self.batch_size):
            rows = fits[start : start + self.batch_size]
            try:
                outputs = self._generate([encoded[r] for r in rows])
            except Exception:  # noqa: BLE001 - the batch failed: try its rows one by one, so only bad rows fail
                outputs = []
                for r in rows:
                    try:
                        outputs.append(self._generate([encoded[r]])[0])
                    except Exception as exc:  # noqa: BLE001 - reported in the row's error column
                        outputs.append(("", [], f"{type(exc).__name__}: {exc}"))
            for r, out in zip(rows, outputs):
                results[r] = out
        out = dict(batch)
        out["generated_text"] = np.array([r[0] for r in results], dtype=object)
        ids = np.empty(len(results), dtype=object)
        for i, r in enumerate(results):
            ids[i] = np.asarray(r[1], dtype=np.int64)
        out["generated_token_ids"] = ids
        out["error"] = np.array([r[2] for r in results], dtype=object)
        return out

    def _generate(self, prompts: list[list[int]]) -> list[tuple[str, list[int], None]]:
        """One ``generate`` call on at most ``batch_size`` tokenized prompts, padded to exactly ``batch_size`` rows
        (copies of the last prompt, dropped from the result)."""
        n = len(prompts)
        padded = prompts + [prompts[-1]] * (self.batch_size - n)
        enc = self.tokenizer.pad({"input_ids": padded}, padding=True, return_tensors="pt")
        # (no torch.inference_mode(): the graphs were warmed up outside it, and their guards check the grad mode)
        out = self.model.generate(enc["input_ids"], attention_mask=enc["attention_mask"],
                                  max_new_tokens=self.max_new_tokens, **self.generate_kwargs)  # fmt: skip
        new = out[:n, enc["input_ids"].shape[1] :].tolist()
        results = []
        for tokens in new:
            tokens = self.trim(tokens)
            results.append((self.tokenizer.decode(tokens, skip_special_tokens=True), tokens, None))
        return results

    def trim(self, tokens: list[int]) -> list[int]:
        """The generated tokens up to and including the first end-of-sequence token (what follows it is padding).

        Args:
            tokens: the new tokens of one row, as ``generate`` returned them.

        Returns:
            The tokens kept in ``generated_token_ids``.
        """
        for i, token in enumerate(tokens):
            if token in self.eos_ids:
                return tokens[: i + 1]
        return tokens
