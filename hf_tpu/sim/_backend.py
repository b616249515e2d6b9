"""The ``"tpu"`` torch.compile backend of the simulated device: aot_eager underneath, every compile counted.

Dynamo calls a backend once per graph it compiles (each new shape with ``dynamic=False``, each graph break),
which is what costs a real TPU an XLA compile; the simulator counts those calls as ``stats().compiles``, once each
returns a compiled graph (a call that ends in a dynamo restart of the same frame is not a compile).
Ops run inside a compiled graph do not add eager shape signatures (torch_tpu runs the graph as one program).
It is registered only in simulated mode and never replaces torch_tpu's own backend on a real TPU.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hf_tpu._torch_tpu import HOST_READ_REFUSED
from hf_tpu.sim import _precision
from hf_tpu.sim._counters import STATE, SimStrictError, graph_run

__all__ = ["DECOMPOSITIONS", "note_cache_hit", "register", "tpu_backend"]

TAKEN_OVER: dict[str, Any] = {}
#: The AOTAutograd decompositions this backend traces with, read at each compile: the counterpart of torch_tpu 0.2.0's
#: ``torch_tpu._internal.compile._backend._TPU_DECOMPOSITIONS``, where hf_tpu adds its own (``hf_tpu._group_norm``)
#: as it does to the wheel's. Empty by default (the wheel's masked_fill entries are not mirrored).
DECOMPOSITIONS: dict[Any, Any] = {}
_LOG = logging.getLogger("hf_tpu.sim")


def _in_graph(fn: Any) -> Any:
    # the float32 matmul precision the graph was compiled at is the one it runs at (hf_tpu.sim._precision.compiled_at)
    precision = _precision.current()

    def run(args: list) -> Any:
        with graph_run(), _precision.compiled_at(precision):
            return fn(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


# torch_tpu 0.2.0's refusal of a graph that reads a device value on the host (its eager ``_local_scalar_dense``
# kernel, met while it lowers the graph's FX nodes), word for word.
HOST_READ_REFUSAL = f"local_scalar_dense(): {HOST_READ_REFUSED}"
_HOST_READ_SITES: set[str] = set()  # the source lines already warned about, once per process
# Every compiled graph's first host read, in compile order (a site once per graph that has one, warned or not): what
# ``hf_tpu.sim.host_reads`` returns.
HOST_READS: list[str] = []


# ops whose output shape is a count of a device tensor's values: torch_tpu 0.2.0 computes it on the host while it
# lowers the graph ("nonzero(): cannot record EventSnapshot during an FX trace"), and refuses, as for a host read
_COUNTED = ("nonzero", "masked_select", "unique", "_unique2", "unique_consecutive")
_INDEXED = ("index",)
# assignments through an index: torch_tpu 0.2.0 lowers a boolean-mask one whose value broadcasts to the whole target
# (``x[mask] = 0``, ``x[row_mask] = row``: a select, as transformers' vocabulary-parallel embedding masks ids) and
# refuses one whose value has a row per masked position ("index_put_(): cannot record EventSnapshot during an FX
# trace"), checked against the wheel by tests/contract (``lower_host_reads``)
_PUT = ("index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put")


def _val(arg):
    return getattr(arg, "meta", {}).get("val") if isinstance(arg, torch.fx.Node) else None


def _boolean(index) -> bool:
    return getattr(_val(index), "dtype", None) in (torch.bool, torch.uint8)


def _reads_host(node: torch.fx.Node) -> str | None:
    """Whether the aten op of ``node`` reads a device value on the host when torch_tpu lowers it: ``.item()`` and
    its kin (``_local_scalar_dense``), an op shaped by a count of values (``nonzero``, ...), an index by a boolean mask
    (``x[mask]``: a ``nonzero`` of the mask), or an assignment through one whose value has a row per masked position
    (``x[mask] = rows``). Returns the op torch_tpu's refusal names (``"local_scalar_dense"``, ``"nonzero"``,
    ``"index_put_"``), or None."""
    packet = getattr(node.target, "_overloadpacket", None)
    name = getattr(packet, "__name__", "")
    if node.target is torch.ops.aten._local_scalar_dense.default:
        return "local_scalar_dense"
    if name in _COUNTED:
        return "nonzero"
    indices = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) else ()
    if name in _INDEXED and any(_boolean(index) for index in indices):
        return "nonzero"
    if name in _PUT and any(_boolean(index) for index in indices):
        target, value = _val(node.args[0]), _val(node.args[2]) if len(node.args) > 2 else None
        if target is None or value is None:
            return "index_put_"
        try:
            broadcasts = tuple(torch.broadcast_shapes(value.shape, target.shape)) == tuple(target.shape)
        except RuntimeError:
            broadcasts = False
        return None if broadcasts and len(indices) == 1 else "index_put_"
    return None


def _host_read_site(gm: torch.fx.GraphModule) -> tuple[str, str] | None:
    """The source line of the first read of a device value on the host (``aten._local_scalar_dense``: ``.item()``,
    ``.tolist()``, a tensor check; a boolean-mask index or ``nonzero``: :func:`_reads_host`) in the graph ``gm`` and
    the op torch_tpu's refusal names; None when it has none."""
    for node in gm.graph.nodes:
        op = _reads_host(node) if node.op == "call_function" else None
        if op:
            frames = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines() if line.strip()]
            files = [i for i, line in enumerate(frames) if line.startswith("File ")]
            if not files:
                return "an unknown line", op
            last = files[-1]
            return " ".join(frames[last : last + 2]), op
    return None


def _refuse_host_read(gm: torch.fx.GraphModule) -> None:
    """Refuse a graph that reads a device value on the host, as torch_tpu does while it lowers one: a RuntimeError
    with torch_tpu's words (:data:`HOST_READ_REFUSAL`, the op it names), then the source line of the read. The site
    is recorded (:func:`hf_tpu.sim.host_reads`) and logged once per source line."""
    found = _host_read_site(gm)
    if found is None:
        return
    site, op = found
    HOST_READS.append(site)
    refusal = HOST_READ_REFUSAL.replace("local_scalar_dense", op)
    if site not in _HOST_READ_SITES:
        _HOST_READ_SITES.add(site)
        _LOG.warning(
            "hf_tpu.sim: a compiled graph reads a device value on the host (%s); torch_tpu refuses to lower such a "
            "graph (%r), and so does the simulator. Compute the value on the host before the graph, or keep it on "
            "the device.",
            site,
            refusal,
        )
    raise RuntimeError(
        f"{refusal} [hf_tpu.sim: the graph reads a device value on the host at {site}; torch_tpu refuses to lower "
        "it. Compute the value on the host before the graph, or keep it on the device.]"
    )


def _compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    from torch._functorch import config as functorch_config

    _refuse_host_read(gm)
    from torch._functorch.aot_autograd import make_boxed_func

    if functorch_config.bundled_autograd_cache or functorch_config.force_autograd_cache:
        # Ahead-of-time compile (hf_tpu.compile_cache): an OutputCode that torch can serialize and load back.
        from torch.fx.graph import _BoxedCodeGen

        gm.graph.set_codegen(_BoxedCodeGen())
        gm.recompile()
        code = _output_code_class()(gm=gm)
        code._boxed_call = True
        return code
    return _in_graph(make_boxed_func(gm.forward))


_OUTPUT_CODE: list = []


def _output_code_class() -> type:
    """torch's serializable aot_eager OutputCode, run as one graph (no eager shape signatures counted)."""
    if not _OUTPUT_CODE:
        from torch._dynamo.backends.debugging import AOTEagerOutputCode

        class _SimOutputCode(AOTEagerOutputCode):
            def __call__(self, inputs: Any) -> Any:
                with graph_run():
                    return super().__call__(inputs)

        _SimOutputCode.__module__, _SimOutputCode.__qualname__ = __name__, "_SimOutputCode"
        _OUTPUT_CODE.append(_SimOutputCode)
    return _OUTPUT_CODE[0]


def __getattr__(name: str) -> Any:  # pickle finds the lazily built class by name when a cached graph loads
    if name == "_SimOutputCode":
        return _output_code_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def note_cache_hit() -> None:
    """Count a graph served by hf_tpu's persistent compile cache (``stats().compile_cache_hits``)."""
    STATE.compile_cache_hits += 1


def _describe(example_inputs: Any) -> str:
    shapes = [tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)][:6]
    return f"inputs {shapes}" + (" ..." if len(example_inputs) > 6 else "")


def tpu_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
    """Compile ``gm`` for the simulated device (aot_eager) and count one compile.

    Example:
        >>> import torch, hf_tpu.sim
        >>> f = torch.compile(lambda x: x * 2 + 1, backend="tpu", dynamic=False)
        >>> with hf_tpu.sim.stats() as s:
        ...     _ = f(torch.ones(3, device="tpu"))
        >>> s.compiles
        1
    """
    if STATE.strict_compiles:
        raise SimStrictError(
            f"compile inside hf_tpu.sim.strict(): graph with {len(gm.graph.nodes)} nodes, "
            f"{_describe(example_inputs)}. A new shape (or a graph break) compiled a new graph; warm the shape up "
            "first, pad inputs to a bucket, or mark the dimension dynamic."
        )
    from torch._dynamo.backends.common import aot_autograd

    extra = {"decompositions": dict(DECOMPOSITIONS)} if DECOMPOSITIONS else {}
    compiled = aot_autograd(
        fw_compiler=_compiler, bw_compiler=_compiler, keep_inference_input_mutations=True, **extra
    )(gm, example_inputs, **kwargs)
    # Counted once compiled: AOT autograd can raise RestartAnalysis instead (a Python float dynamo traced as a
    # symbol, such as a numpy scalar attribute of NCSN++'s blocks, must be specialized), and dynamo then traces the
    # same frame again and calls this backend a second time for the one graph a chip compiles.
    STATE.compiles += 1
    STATE.last_compile = _describe(example_inputs)
    return compiled


# The simulator's op kernels, written in Python, that the dispatcher calls: on a chip they are torch_tpu's C++. Where a
# compiled function falls back to eager code (a graph break), dynamo would otherwise try to compile these frames
# too, counting graphs and recompiles that a chip never has.
_DISPATCH_MODULES = (
    "hf_tpu.sim._ops",
    "hf_tpu.sim._tensors",
    "hf_tpu.sim._precision",
    "hf_tpu.sim._counters",
    "hf_tpu.sim._signature",
    "hf_tpu.sim._native",
    "hf_tpu.sim._pinned",
    "hf_tpu.sim._attention",
)


_SKIPPED: set[str] = set()  # the modules handed to dynamo's skip list in this process


def register() -> None:
    """Make ``backend="tpu"`` this backend, keeping aside any ``"tpu"`` backend registered before (torch_tpu's),
    and keep dynamo out of the simulator's op kernels."""
    from torch._dynamo import trace_rules
    from torch._dynamo.backends import registry  # no _lazy_import(): this runs while dynamo is being imported

    # Once per process: trace_rules.add appends to dynamo's skip list and recompiles one regex over all of it, so
    # adding the same modules on every enable() made each later enable, and every file check while tracing, slower.
    for module in _DISPATCH_MODULES:
        if module not in _SKIPPED:
            trace_rules.add(module)
            _SKIPPED.add(module)

    current = registry._COMPILER_FNS.get("tpu")
    if current is tpu_backend:
        return
    if current is not None:
        TAKEN_OVER["tpu"] = current
        del registry._COMPILER_FNS["tpu"]
    registry._BACKENDS.pop("tpu", None)
    registry.register_backend(compiler_fn=tpu_backend, name="tpu")
