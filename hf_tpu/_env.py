"""Every ``HF_TPU_*`` environment variable hf_tpu reads, in one table (issue #66).

Switches read wherever they were needed multiplied (14, then 18 variables) and nothing said which of them change
what a compiled graph computes, although a graph stored in the persistent compile cache by one process is
loaded by the next. Here each variable is one :class:`Var`: its name, how its text is parsed, its default, what it
does and whether it changes a graph (``graph=True``). The rules that keep it so:

* hf_tpu reads an ``HF_TPU_*`` variable only through this table (``_env.KV_WRITE.get()``); tests/test_house.py
  refuses an ``os.environ`` / ``os.getenv`` read of one anywhere else. Code that *sets* a variable for a child
  process may write it (``hf-tpu launch`` gives its ranks ``os.environ[_env.SIM_GENERATION.name]``);
* a variable that changes what a traced graph computes (a kernel form, an attention form, where a cache is written)
  has ``graph=True``, and :func:`graph_key` folds its value into every compile-cache namespace's key
  (:meth:`hf_tpu.compile_cache.CompileCache.namespace`): a process with another value never loads the first one's
  graphs. A variable whose effect is already in the key some other way (the runtime mode, the cache sizing, a
  tensor-parallel layout) or that changes no graph says so in its doc;
* a value is read when it is asked for, never cached here (a test's ``monkeypatch.setenv`` takes effect at once);
  modules that read once per process (the simulator's matmul precision) keep doing so themselves;
* docs/environment.md's table is :func:`markdown`'s output (``python -m hf_tpu._env`` prints it); a test compares.

This module imports nothing heavy: ``import hf_tpu`` reads ``HF_TPU_SIMULATE`` through it.

Example:
    >>> from hf_tpu import _env
    >>> _env.KV_WRITE.name, _env.KV_WRITE.graph
    ('HF_TPU_KV_WRITE', True)
    >>> _env.VARS["HF_TPU_DEBUG"] is _env.DEBUG
    True
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_tpu.errors import HfTpuValueError, InvalidArgumentError

__all__ = ["VARS", "Var", "graph_key", "markdown"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Var:
    """One ``HF_TPU_*`` environment variable.

    Attributes:
        name: the variable's name, ``HF_TPU_...``.
        parse: turns its text (stripped, never empty) into the value; raises :class:`InvalidArgumentError` naming
            the variable, the text and the values it takes.
        default: the value while it is unset or empty.
        values: what it takes, for the docs (``auto, graph, after``).
        doc: what it does, and why it does or does not change a graph.
        graph: whether it changes what a traced graph computes (then :func:`graph_key` holds it).
        choices: the words it takes, for a variable that takes one of a few (the first is the default); empty for
            any other.
        default_doc: how the docs name the default when ``repr(default)`` would not say it (a path under ``~``).
    """

    name: str
    parse: Callable[[str], Any]
    default: Any
    values: str
    doc: str
    graph: bool = False
    choices: tuple[str, ...] = ()
    default_doc: str = ""

    def text(self) -> str:
        """The variable's text as set, stripped; ``""`` when unset.

        Returns:
            The stripped text.
        """
        return (os.environ.get(self.name) or "").strip()

    def is_set(self) -> bool:
        """Whether the variable holds something other than blanks.

        Returns:
            True when :meth:`text` is not empty.
        """
        return bool(self.text())

    def get(self) -> Any:
        """The variable's value now: :attr:`default` when unset or empty, else its text parsed.

        Returns:
            The parsed value, or the default.

        Raises:
            ValueError (InvalidArgumentError): the text is not a value the variable takes.
        """
        text = self.text()
        return self.default if not text else self.parse(text)


VARS: dict[str, Var] = {}


def _register(var: Var) -> Var:
    if not var.name.startswith("HF_TPU_"):
        raise HfTpuValueError(f"{var.name}: the table holds HF_TPU_* variables only")
    if var.name in VARS:
        raise HfTpuValueError(f"{var.name} is registered twice in hf_tpu._env")
    VARS[var.name] = var
    return var


def _flag(name: str, doc: str) -> Var:
    """A switch: on for 1/true/yes/on (any case), off otherwise."""
    return _register(Var(name, lambda text: text.lower() in _TRUE, False, "1, true, yes, on (any case): on", doc))


def _present(name: str, doc: str) -> Var:
    """On when set to anything but blanks."""
    return _register(Var(name, lambda text: True, False, "any non-empty value: on", doc))


def _choice(name: str, choices: tuple[str, ...], what: str, doc: str, graph: bool = False) -> Var:
    """One of a few words (any case); the first is the default."""

    def parse(text: str) -> str:
        value = text.lower()
        if value not in choices:
            raise InvalidArgumentError(
                f"{name}={value!r} is not {what}; use one of {', '.join(choices)}, or unset it for {choices[0]}."
            )
        return value

    return _register(Var(name, parse, choices[0], ", ".join(choices), doc, graph=graph, choices=choices))


def _text(name: str, values: str, doc: str, default_doc: str = "unset") -> Var:
    """Free text (a path, a generation's name)."""
    return _register(Var(name, lambda text: text, None, values, doc, default_doc=default_doc))


def _number(name: str, kind: type, what: str, doc: str, default: Any = None) -> Var:
    """A positive ``kind`` (int or float)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value <= 0:
            raise InvalidArgumentError(f"{name}={text!r}: give {what}, or unset it.")
        return value

    return _register(Var(name, parse, default, what, doc))


def _strict(text: str) -> bool | str:
    value = text.lower()
    return "eager" if value == "eager" else value in _TRUE


def _gib(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        message = f"HF_TPU_KV_CACHE_GIB={text!r} is not a number of GiB (for example 2 or 0.5)"
        raise InvalidArgumentError(message) from None


def _tristate(text: str) -> bool | None:
    value = text.lower()
    return True if value in _TRUE else False if value in _FALSE else None


# ---- the simulator ------------------------------------------------------------------------------------------------

SIMULATE = _flag(
    "HF_TPU_SIMULATE",
    "Enable the simulated `tpu` device (CPU memory) at `import hf_tpu` (and at `import torch`, through hf_tpu's "
    "autoload entry point), as `hf_tpu.sim.enable()` or `--simulate` do. Not a graph switch: the runtime mode is "
    "part of every compile-cache key already.",
)
SIM_GENERATION = _text(
    "HF_TPU_SIM_GENERATION",
    "a generation's name: v5e, v5p, v6e, ...",
    "The TPU generation a rank of `hf-tpu launch --simulate` simulates (the launcher sets it for its ranks; "
    "`--sim-generation` wins over it). Not a graph switch: it sets the simulated host's chips and HBM, not what a "
    "graph computes.",
    default_doc="v6e (or the first generation with the process count asked)",
)
SIM_HBM = _number(
    "HF_TPU_SIM_HBM",
    int,
    "the HBM of each simulated device in bytes",
    "The HBM size a rank of `hf-tpu launch --simulate` gives its simulated device, when the launcher was given one "
    "(set by the launcher). Not a graph switch: what depends on the HBM (cache sizing) is in the compile-cache "
    "key itself.",
)
SIM_DEVICES = _number(
    "HF_TPU_SIM_DEVICES",
    int,
    "a number of simulated TPU devices, e.g. 4",
    "The devices on a simulated host, as torch_tpu counts a real one's (`torch.tpu.distributed."
    "set_tpu_launch_env` on the simulator). Not a graph switch: it sets how many ranks a launch starts.",
    default=4,
)
SIM_NATIVE = _register(
    Var(
        "HF_TPU_SIM_NATIVE",
        _tristate,
        None,
        "0, false, no, off: the Python path; 1, true, yes, on: the native core or an error",
        "Whether the simulator runs its ops through its native core (a C++ extension built on first use): unset, "
        "where it builds; `0`, never; `1`, a failed build is an error. Not a graph switch: both paths compute the "
        "same values.",
        default_doc="unset: where it builds",
    )
)
SIM_MATMUL_PRECISION = _choice(
    "HF_TPU_SIM_MATMUL_PRECISION",
    ("medium", "high", "highest"),
    "a float32 matmul precision",
    "The simulated device's initial float32 matmul precision (read once per process, when the simulator starts; "
    "`torch.set_float32_matmul_precision` changes it later). A graph switch: a float32 product the graph computes "
    "at `medium` (one bfloat16 pass) differs from one at `highest`.",
    graph=True,
)
CACHE = _text(
    "HF_TPU_CACHE",
    "a directory",
    "Where hf_tpu keeps what it builds for this host: the simulator's native core (`sim-native/` under it). Not a "
    "graph switch: it holds no graph.",
    default_doc="~/.cache/hf_tpu",
)

# ---- compiling and the compile cache ------------------------------------------------------------------------------

COMPILE_CACHE = _text(
    "HF_TPU_COMPILE_CACHE",
    "a directory",
    "The persistent compile cache's directory when no `cache_dir=` / `--compile-cache` is given (set before "
    "`import hf_tpu`, it also points torch_tpu's own caches there on a chip). Not a graph switch: it says where "
    "graphs are kept.",
)
STRICT_COMPILE = _register(
    Var(
        "HF_TPU_STRICT_COMPILE",
        _strict,
        False,
        "1, true, yes, on: strict; eager: strict about eager op compiles too",
        "Strict mode for every model (`configure(strict=...)` per model wins): after warm-up, a call that needs a "
        "new graph raises instead of compiling it. Not a graph switch: it refuses compiles, it changes none.",
    )
)

# ---- what the graphs compute (graph switches) ---------------------------------------------------------------------

KV_WRITE = _choice(
    "HF_TPU_KV_WRITE",
    ("auto", "graph", "after"),
    "a KV write mode",
    "Where a decode step's new K/V rows are written into a full-attention cache on a `tpu` device: `graph` (in the "
    "graph, upstream's `index_copy_`), `after` (after each decode graph), `auto` (after the graph once each layer's "
    "K and V hold 32 MiB). A graph switch: read while a decode graph is traced, it decides whether that graph writes "
    "its cache.",
    graph=True,
)
KV_ROWS_WRITER = _choice(
    "HF_TPU_KV_ROWS_WRITER",
    ("auto", "index_copy", "jax"),
    "a KV rows writer",
    "How the rows a decode graph left are written after it: `index_copy` (one eager op per layer's keys and "
    "values), `jax` (one JAX program for every layer, on torch_tpu's device with `jax`), `auto` (`jax` where it can "
    "run). Not a graph switch: the write runs after the graph, outside it.",
)
DECODE_ATTENTION = _choice(
    "HF_TPU_DECODE_ATTENTION",
    ("grouped", "sdpa", "packed", "ragged_kernel"),
    "a decode attention form",
    "The one-token attention form on a `tpu` device: `grouped` (two products grouped by KV head), `sdpa` "
    "(upstream's call, torch_tpu's flash kernel), `packed` (upstream's `pack_gqa`), `ragged_kernel` (the "
    "decode-attention-tpu Hub kernel: a Pallas kernel reading each row's filled cache slots only; not measured on a "
    "chip). A graph switch: read while a decode graph is traced, it picks the attention that graph computes.",
    graph=True,
)
MEASURED_EXPERTS = _choice(
    "HF_TPU_MEASURED_EXPERTS",
    ("auto", "1", "torch", "0"),
    "a measured experts choice",
    "The MoE experts implementation a TPU-placed model gets: `auto`/`1` (every measured form on a TPU VM, the "
    "torch forms elsewhere), `torch` (the torch forms only), `0` (keep transformers' default). A graph switch: it "
    "picks the experts kernel each bucket's graph runs.",
    graph=True,
)

# ---- training -----------------------------------------------------------------------------------------------------

OPTIMIZER = _choice(
    "HF_TPU_OPTIMIZER",
    ("compiled", "eager"),
    "an optimizer step mode",
    "How the optimizer's update and the gradient clipping run on a `tpu` device (`hf_tpu.training.AdamW` and "
    "`clip_grad_norm_`, which the Trainer uses through `hf_tpu.enable()`): `compiled` (graphs compiled with "
    "`torch.compile(backend=\"tpu\")`, one per bucket of parameters of one shape and dtype), `eager` (upstream's "
    "eager ops). Not a graph switch: the model's graphs are the same either way.",
)

# ---- serving, commands and checks ---------------------------------------------------------------------------------

KV_CACHE_GIB = _register(
    Var(
        "HF_TPU_KV_CACHE_GIB",
        _gib,  # its sign is checked where it is used, with the flag's value (hf_tpu.serving.kv_sizing)
        None,
        "a number of GiB, e.g. 2 or 0.5",
        "A cap on the serving KV cache when `--kv-cache-gib` / `configure(kv_cache_gib=...)` is not given. Not a "
        "graph switch: the cache's size is part of the step graphs' compile-cache key itself.",
    )
)
SERVE_TP = _number(
    "HF_TPU_SERVE_TP",
    int,
    "the tensor-parallel size",
    "Set by `hf-tpu serve --tp N` for its ranks: the serve command runs as a rank of an N-way launch. Not a graph "
    "switch: a tensor-parallel model's layout is part of its compile-cache key itself.",
)
QUIET_WARMUP = _present(
    "HF_TPU_QUIET_WARMUP",
    "Leave out the log line continuous batching's warm-up writes when it ends. Not a graph switch.",
)
DEBUG = _flag(
    "HF_TPU_DEBUG",
    "Show the full traceback of an `hf-tpu` command's error (as `--debug` does), and `hf-tpu selftest`'s output on "
    "stderr. Not a graph switch.",
)
SELFTEST_TIMEOUT_S = _number(
    "HF_TPU_SELFTEST_TIMEOUT_S",
    float,
    "a positive number of seconds",
    "Bounds the self-test's tensor-parallel launch (unset: it waits; the launcher stops every rank once one "
    "fails). Not a graph switch.",
)
BENCH_DEBUG = _present(
    "HF_TPU_BENCH_DEBUG",
    "`hf-tpu bench serve` prints its whole figures as JSON after its table. Not a graph switch.",
)


def graph_key() -> dict[str, Any]:
    """The graph switches set to something other than their default, by name: what
    :meth:`hf_tpu.compile_cache.CompileCache.namespace` adds to every namespace's key, so that a graph stored under
    one value is never loaded under another. Empty when every switch is at its default (a key made before the
    table existed stays valid). A text its variable refuses is kept as it is (the code that reads the variable
    raises, with its message; a key never does).

    Returns:
        ``{name: value}``, sorted by name.
    """
    key = {}
    for name in sorted(VARS):
        var = VARS[name]
        if not var.graph or not var.is_set():
            continue
        try:
            value = var.get()
        except InvalidArgumentError:
            value = var.text()
        if value != var.default:
            key[name] = value
    return key


def _default_doc(var: Var) -> str:
    if var.default_doc:
        return var.default_doc
    if var.default is None:
        return "unset"
    if var.default is False:
        return "off"
    return f"`{var.default}`"


def markdown() -> str:
    """The table of every variable, as docs/environment.md shows it.

    Returns:
        A markdown table, one row per variable, sorted by name, with a trailing newline.
    """
    rows = ["| variable | values | default | graph switch | what it does |", "|---|---|---|---|---|"]
    for name in sorted(VARS):
        var = VARS[name]
        cells = [f"`{name}`", var.values, _default_doc(var), "**yes**" if var.graph else "no", var.doc]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
