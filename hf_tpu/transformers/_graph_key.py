"""The kind of a compiled generation graph as a value: :class:`GraphKind`, its base graph and the :class:`Variant` a
call adds to it; each kind's registered :class:`GraphSpec`; the key read by name, :class:`GraphKey`.

A graph key is ``(kind, batch, *shapes)`` (read by name through :class:`GraphKey`).
The kind says which graph function runs (its :attr:`GraphKind.base`: ``"prefill"``, ``"decode"``, ``"beam_decode"``,
...) and what the call traced into it besides its shapes (its :attr:`GraphKind.variant`): the device sampling program
(the logits processors and the sampler, in the order they run, :mod:`hf_tpu.transformers.sampling`) and the features
of the call (``"attentions"``, ``"token_type_ids"``, ``"mrope"``, beam search's shape, ...; a set: their order means
nothing).

Its text, ``str(kind)`` (``"decode+temperature+top_k+sample+attentions"``), is what hf_tpu shows and stores: in
:func:`~hf_tpu.transformers.compiled_graphs`, warm-up reports, the names of graphs in the persistent compile cache and
its manifest, the docs. The text lists the sampling program first, in its order, then the features in the order of
:data:`FEATURE_ORDER` (the order the loops appended them in when kinds were strings, so every name written before
kinds were typed is written the same now). :meth:`GraphKind.parse` reads such a text back: only where one comes from
outside the process (a compile-cache manifest, a caller's argument); inside hf_tpu a kind is built, never parsed.

Example:
    >>> kind = GraphKind("decode", Variant(("top_k", "sample"), frozenset({"attentions"})))
    >>> str(kind)
    'decode+top_k+sample+attentions'
    >>> GraphKind.parse("decode+top_k+sample+attentions") == kind
    True

Graph kinds as registered specs (issue #66): one :class:`GraphSpec` per kind, and the graph key read by name.

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

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hf_tpu.errors import HfTpuTypeError, InvalidArgumentError, InvalidTypeError

__all__ = ["FEATURE_ORDER", "IMAGE_ROLES", "NO_VARIANT", "GraphKey", "GraphKind", "GraphSpec", "Variant", "graph_spec",
           "graph_specs", "public_key", "register_graph", "unregister_graph"]

# The features a graph kind can carry, in the order its text lists them: beam search's shape (beams, continuations
# kept per step, end-of-sequence ids checked: "beams4x8e1"), its early stopping and beam sampling
# (hf_tpu.transformers._loops.beam); the outputs asked (hf_tpu.transformers._step_outputs); the model inputs that
# make graphs of their own (token types, rows of positions, Gemma 4's image-token types).
FEATURE_ORDER: tuple[str | re.Pattern, ...] = (
    re.compile(r"beams\d+x\d+e\d+"),
    "early",
    "never",
    "beam_sample",
    "attentions",
    "hidden_states",
    "token_type_ids",
    "mrope",
    "mm_token_type_ids",
)
SEPARATOR = "+"


def _rank(feature: str) -> int | None:
    """The place of ``feature`` in :data:`FEATURE_ORDER`, None for a name that is not a feature."""
    for i, entry in enumerate(FEATURE_ORDER):
        if entry == feature if isinstance(entry, str) else entry.fullmatch(feature):
            return i
    return None


def _check_part(part: object, what: str) -> None:
    if not isinstance(part, str) or not part or SEPARATOR in part:
        raise InvalidArgumentError(f"a graph kind's {what} is a non-empty string without {SEPARATOR!r}, got {part!r}")


@dataclass(frozen=True, slots=True)
class Variant:
    """What a call traces into each of its graphs besides their shapes: the device sampling program ``sampling``
    (the processors' labels in the order they run, ``"sample"`` last when sampling; ``()`` for greedy search or the
    host path) and the call's ``features`` (names from :data:`FEATURE_ORDER`). Hashable; ``str()`` is the suffix
    hf_tpu appends to the base's name (``"+top_k+sample+attentions"``, ``""`` for none).

    Args:
        sampling: the sampling program's labels, in order (duplicates kept: the program runs each).
        features: the call's features, in any order.

    Raises:
        ValueError: a label or feature that is empty or holds ``"+"``, or a feature :data:`FEATURE_ORDER` does not
            name.
    """

    sampling: tuple[str, ...] = ()
    features: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sampling", tuple(self.sampling))
        object.__setattr__(self, "features", frozenset(self.features))
        for label in self.sampling:
            _check_part(label, "sampling label")
        for feature in self.features:
            _check_part(feature, "feature")
            if _rank(feature) is None:
                raise InvalidArgumentError(
                    f"{feature!r} is not a graph feature hf_tpu knows (FEATURE_ORDER in {__name__})"
                )

    def with_features(self, *features: str) -> Variant:
        """This variant with ``features`` added."""
        return Variant(self.sampling, self.features | frozenset(features))

    @property
    def parts(self) -> tuple[str, ...]:
        """The sampling labels in their order, then the features in :data:`FEATURE_ORDER`'s."""
        return self.sampling + tuple(sorted(self.features, key=lambda f: (_rank(f), f)))

    def __str__(self) -> str:
        return "".join(SEPARATOR + part for part in self.parts)

    def __repr__(self) -> str:
        return f"Variant.parse({str(self)!r})"

    def __bool__(self) -> bool:
        return bool(self.sampling or self.features)

    @classmethod
    def parse(cls, text: str) -> Variant:
        """The variant whose text is ``text`` (``"+top_k+sample+attentions"``, ``""``): for text from outside the
        process only (see the module docstring). A part :data:`FEATURE_ORDER` names is a feature, the others are
        sampling labels, which come first.

        Raises:
            ValueError: ``text`` is not such a text (no leading ``"+"``, an empty part, a sampling label after a
                feature).
            TypeError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise InvalidTypeError(f"a graph variant's text is a string, got {text!r}")
        if not text:
            return cls()
        if not text.startswith(SEPARATOR):
            raise InvalidArgumentError(f"a graph variant's text starts with {SEPARATOR!r}, got {text!r}")
        sampling: list[str] = []
        features: list[str] = []
        for part in text[len(SEPARATOR) :].split(SEPARATOR):
            if _rank(part) is not None:
                features.append(part)
            elif features:
                raise InvalidArgumentError(
                    f"{text!r}: the sampling label {part!r} follows a feature (hf_tpu writes them first)"
                )
            else:
                sampling.append(part)
        return cls(tuple(sampling), frozenset(features))


# The variant of plain greedy search: no sampling program, no feature.
NO_VARIANT = Variant()


@dataclass(frozen=True, slots=True)
class GraphKind:
    """The kind of a compiled generation graph: ``base``, the graph function (its registered
    :class:`GraphSpec`'s base), and the call's :class:`Variant`. Hashable, equal
    when base and variant are; ``str()`` (and :attr:`name`) is the name hf_tpu shows and stores
    (``"decode+top_k+sample"``).

    Args:
        base: the graph function's name.
        variant: what the call traces into the graph besides its shapes (none by default).

    Raises:
        ValueError: a ``base`` that is empty or holds ``"+"``.
    """

    base: str
    variant: Variant = field(default_factory=Variant)

    def __post_init__(self) -> None:
        _check_part(self.base, "base")
        if not isinstance(self.variant, Variant):
            raise HfTpuTypeError(f"a graph kind's variant is a Variant, got {self.variant!r}")

    @property
    def features(self) -> frozenset[str]:
        """The call's features (:attr:`Variant.features`)."""
        return self.variant.features

    @property
    def sampling(self) -> tuple[str, ...]:
        """The device sampling program's labels, in order (:attr:`Variant.sampling`)."""
        return self.variant.sampling

    @property
    def name(self) -> str:
        """The kind's text: the base, then the variant's parts, each after a ``"+"``."""
        return self.base + str(self.variant)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"GraphKind.parse({self.name!r})"

    def with_features(self, *features: str) -> GraphKind:
        """This kind with ``features`` added to its variant."""
        return GraphKind(self.base, self.variant.with_features(*features))

    @classmethod
    def parse(cls, text: str) -> GraphKind:
        """The kind whose text is ``text`` (``"decode+top_k+sample"``): for text from outside the process only, such
        as a compile-cache manifest an earlier process (or an earlier hf_tpu) wrote.

        Raises:
            ValueError: ``text`` is not a kind's text (see :meth:`Variant.parse`).
            TypeError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise InvalidTypeError(f"a graph kind's text is a string, got {text!r}")
        base, sep, rest = text.partition(SEPARATOR)
        _check_part(base, "base")
        return cls(base, Variant.parse(sep + rest))


def public_key(key: tuple) -> tuple:
    """A graph key as hf_tpu shows and stores it: its kind as text (``("decode+top_k+sample", 1, 64)``)."""
    kind, *dims = key
    return (str(kind), *dims)


# ----- graph kinds as registered specs -----

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
