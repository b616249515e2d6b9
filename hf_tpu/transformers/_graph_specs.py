"""Graph kinds as registered specs (issue #66): one :class:`GraphSpec` per kind, and the graph key read by name.

A kind used to live in two tables (the bodies in ``_graphs.GRAPHS``, the names of its key's dims in
``_graphs._describe``), and :func:`~hf_tpu.transformers._graphs.run_graph` compared kind strings to decide what to do
around a graph. A spec holds all of it in one entry: the base name (:attr:`GraphKind.base`), the body that is
compiled, the names of its key's dims after the batch (which make its description), and the flags ``run_graph`` reads
(a new sequence starts, the graph encodes or merges images, its cache length is a host int, it belongs to the loop
without a cache). :func:`register_graph` adds one; registering a base twice is an error. The built-in kinds are
registered by :mod:`hf_tpu.transformers._graphs`, where their bodies live.

A graph key is ``(kind, batch, *dims)``; :class:`GraphKey` is that tuple with names: ``key.kind``, ``key.batch``,
``key.dims`` and ``key.dim("cache bucket")`` (the name from the kind's spec). It is a tuple, equal to (and hashed as)
the plain tuple of its items, and its ``repr`` is the tuple's, so sets of keys, the compile cache's graph names
(:func:`~hf_tpu.transformers._graph_key.public_key`) and the warm-up reports read as before.

Example:
    >>> spec = GraphSpec("my_decode", body=lambda model, ids: ids, fields=("cache bucket",), doc="a decode step")
    >>> register_graph(spec)
    >>> key = GraphKey(GraphKind("my_decode"), 1, 64)
    >>> key.dim("cache bucket"), spec.describe(key)
    (64, 'my_decode graph for batch=1, cache bucket=64')
    >>> unregister_graph("my_decode")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_tpu.errors import InvalidArgumentError
from hf_tpu.transformers._graph_key import GraphKind

__all__ = ["IMAGE_ROLES", "GraphKey", "GraphSpec", "graph_spec", "graph_specs", "register_graph", "unregister_graph"]

#: What a kind does with images: ``"encoder"`` (an image encoder's graph, run before the prefill, keyed by the
#: images), ``"merge"`` (a prefill whose forward merges encoded images into the text).
IMAGE_ROLES = ("encoder", "merge")


@dataclass(frozen=True)
class GraphSpec:
    """One graph kind: what :func:`~hf_tpu.transformers._graphs.run_graph` compiles and runs for it.

    Args:
        base: the kind's base name (:attr:`GraphKind.base`, ``"decode"``).
        body: the graph function, ``body(model, *args)``: a top-level function, so that dynamo keeps one cache of
            compiled entries per kind.
        fields: the names of the key's dims after the batch, in order (``("prompt bucket", "cache bucket")``).
        doc: what the graph is, in a line.
        starts_sequence: the graph starts a new sequence: module-held state is reset before it, as upstream does.
        images: its role with images (:data:`IMAGE_ROLES`), None for none.
        text_base: for a kind that merges images, the base of the same prefill without images: a forward that fails
            to trace here after that one traced fails for its images only.
        host_length: a decode graph that takes its cache length as a dynamic size when the model's route keeps the
            cache length as a host int.
        cacheless: the graph belongs to the loop without a cache: a failed trace moves the model off that loop.

    Raises:
        ValueError: a base that is empty or holds ``"+"``, a body that is not callable, an empty ``doc``, ``fields``
            that are not names, an unknown image role.
    """

    base: str
    body: Callable
    fields: tuple[str, ...]
    doc: str
    starts_sequence: bool = False
    images: str | None = None
    text_base: str | None = None
    host_length: bool = False
    cacheless: bool = False

    def __post_init__(self) -> None:
        GraphKind(self.base)  # (checks the base)
        object.__setattr__(self, "fields", tuple(self.fields))
        if not callable(self.body):
            raise InvalidArgumentError(f"graph kind {self.base!r}: its body is a function, got {self.body!r}")
        if not isinstance(self.doc, str) or not self.doc.strip():
            raise InvalidArgumentError(f"graph kind {self.base!r}: give it a doc saying what the graph is")
        if not all(isinstance(f, str) and f for f in self.fields) or len(set(self.fields)) != len(self.fields):
            raise InvalidArgumentError(
                f"graph kind {self.base!r}: fields name the key's dims after the batch, each once, got {self.fields!r}"
            )
        if self.images is not None and self.images not in IMAGE_ROLES:
            raise InvalidArgumentError(f"graph kind {self.base!r}: images is one of {IMAGE_ROLES} or None, "
                                       f"got {self.images!r}")  # fmt: skip

    def describe(self, key: tuple) -> str:
        """The key in words, as logs and errors show it (``"decode graph for batch=1, cache bucket=64"``)."""
        kind, batch, *dims = key
        return f"{kind} graph for batch={batch}, " + ", ".join(f"{n}={v}" for n, v in zip(self.fields, dims))


_SPECS: dict[str, GraphSpec] = {}


def register_graph(spec: GraphSpec) -> None:
    """Add ``spec``'s kind to the graph kinds :func:`~hf_tpu.transformers._graphs.run_graph` runs.

    Raises:
        ValueError: a kind of that base is registered already.
    """
    if spec.base in _SPECS:
        raise InvalidArgumentError(
            f"graph kind {spec.base!r} is registered already (by {_SPECS[spec.base].body.__module__}): give the new "
            "kind another base name, or unregister_graph the old one first"
        )
    _SPECS[spec.base] = spec


def unregister_graph(base: str) -> GraphSpec:
    """Remove the kind ``base`` (a test's own kind, when the test ends); returns its spec.

    Raises:
        ValueError: no kind of that base is registered.
    """
    spec = graph_spec(base)
    del _SPECS[base]
    return spec


def graph_spec(kind: GraphKind | str) -> GraphSpec:
    """The spec of ``kind`` (a :class:`GraphKind`, or its base name).

    Raises:
        ValueError: no kind of that base is registered.
    """
    base = kind if isinstance(kind, str) else kind.base
    spec = _SPECS.get(base)
    if spec is None:
        raise InvalidArgumentError(
            f"no graph kind {base!r} is registered (registered: {sorted(_SPECS)}); register_graph(GraphSpec(...)) "
            "adds one"
        )
    return spec


def graph_specs() -> tuple[GraphSpec, ...]:
    """Every registered kind's spec, in the order they were registered."""
    return tuple(_SPECS.values())


class GraphKey(tuple):
    """A graph key, ``(kind, batch, *dims)``, with its parts by name; equal to, and hashed as, the plain tuple.

    Args:
        kind: the graph's :class:`GraphKind`.
        batch: the batch size.
        dims: the kind's other dims, in the order its spec's ``fields`` name them.
    """

    __slots__ = ()

    def __new__(cls, kind: Any, batch: Any, *dims: Any) -> GraphKey:
        return super().__new__(cls, (kind, batch, *dims))

    def __getnewargs__(self) -> tuple:
        return tuple(self)

    @classmethod
    def of(cls, key: tuple) -> GraphKey:
        """``key`` as a :class:`GraphKey` (itself when it is one)."""
        return key if isinstance(key, GraphKey) else cls(*key)

    @property
    def kind(self) -> GraphKind:
        """The graph's kind."""
        return self[0]

    @property
    def batch(self) -> int:
        """The batch size."""
        return self[1]

    @property
    def dims(self) -> tuple:
        """The dims after the batch, in order."""
        return tuple(self[2:])

    def dim(self, name: str) -> Any:
        """The dim its kind's spec names ``name`` (``"cache bucket"``).

        Raises:
            ValueError: the kind is not registered, or its spec names no such dim.
        """
        fields = graph_spec(self.kind).fields
        if name not in fields:
            raise InvalidArgumentError(f"a {self.kind.base} graph's key has no dim {name!r}; its dims: {fields}")
        return self[2 + fields.index(name)]
