"""The kind of a compiled generation graph as a value: :class:`GraphKind`, its base graph and the :class:`Variant` a
call adds to it.

A graph key is ``(kind, batch, *shapes)`` (read by name through :class:`~hf_tpu.transformers._graph_specs.GraphKey`).
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
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hf_tpu.errors import HfTpuTypeError, InvalidArgumentError, InvalidTypeError

__all__ = ["FEATURE_ORDER", "NO_VARIANT", "GraphKind", "Variant", "public_key"]

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
    :class:`~hf_tpu.transformers._graph_specs.GraphSpec`'s base), and the call's :class:`Variant`. Hashable, equal
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
