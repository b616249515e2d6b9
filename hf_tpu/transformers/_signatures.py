"""The names hf_tpu calls upstream transformers by, read from the installed version, never assumed.

transformers 5.24 renamed the cache a model's forward takes, the field of its output that returns it, and the field
of ``generate``'s output, from ``past_key_values`` (5.23) to ``cache``. A forward that also takes ``**kwargs``
swallows the name it does not know without a word: given ``cache=`` under 5.23, a Llama runs without a cache, and
the probe that measures what a forward writes would find nothing written and send every call to the slower loop
without a cache. So every call and probe that hands a forward its cache takes the name from here:
:func:`cache_name` reads it from upstream's own ``GenerationMixin.prepare_inputs_for_generation`` (the method that
builds the forward's inputs in ``generate``), and raises :class:`UpstreamSignatureError` when that signature does
not tell (neither name, or both); :func:`model_cache_problem` names a model whose forward takes the other name.

Tested with transformers 5.23.0 (``past_key_values``) and 5.25.0 (``cache``): ``.ci/run`` runs the generation tier on
the oldest version ``pyproject.toml`` declares, the README's command on the newest.
"""

from __future__ import annotations

import inspect

from hf_tpu.errors import HfTpuError

__all__ = ["CACHE_NAMES", "UpstreamSignatureError", "cache_name", "model_cache_problem", "output_cache_field"]

# The cache's name, newest first: 5.24 and later, then 5.23.
CACHE_NAMES = ("cache", "past_key_values")

_NAME: str | None = None


class UpstreamSignatureError(HfTpuError, TypeError):
    """The installed transformers' signatures do not say a name hf_tpu needs (the message names which, and where)."""


def _named(params, where: str) -> str | None:
    found = [name for name in CACHE_NAMES if name in params]
    if len(found) > 1:
        raise UpstreamSignatureError(
            f"{where} takes both {found[0]!r} and {found[1]!r}: hf_tpu cannot tell which one is the cache. Install a "
            "transformers release hf_tpu supports (pyproject.toml's range) or report the version to hf_tpu."
        )
    return found[0] if found else None


def cache_name() -> str:
    """The name the installed transformers passes a model's cache by (``"cache"`` on 5.24+, ``"past_key_values"``
    on 5.23), read once from ``GenerationMixin.prepare_inputs_for_generation``.

    Raises:
        UpstreamSignatureError: that signature names neither or both.
    """
    global _NAME
    if _NAME is None:
        from transformers.generation.utils import GenerationMixin

        where = "transformers' GenerationMixin.prepare_inputs_for_generation"
        params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
        name = _named(params, where)
        if name is None:
            import transformers

            raise UpstreamSignatureError(
                f"{where} (transformers {transformers.__version__}) takes neither 'cache' nor 'past_key_values': "
                "hf_tpu cannot tell how to hand a forward its cache. Install a transformers release hf_tpu supports "
                "(pyproject.toml's range)."
            )
        _NAME = name
    return _NAME


def model_cache_problem(model) -> str | None:
    """Why hf_tpu's cached loop cannot hand ``model``'s forward its cache (a forward that names the cache otherwise
    than the installed transformers does: a model class from another version's code); None when it can."""
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return None
    own = _named(params, f"{type(model).__name__}.forward")
    expected = cache_name()
    if own is not None and own != expected:
        return (
            f"{type(model).__name__}.forward takes its cache as {own!r} where the installed transformers passes "
            f"{expected!r} (a model class written for another transformers version)"
        )
    return None


def output_cache_field(output_class) -> str:
    """The field of ``output_class`` (a ``ModelOutput`` dataclass: a forward's or ``generate``'s output) that holds
    the cache.

    Raises:
        UpstreamSignatureError: the class has neither field.
    """
    fields = getattr(output_class, "__dataclass_fields__", {})
    for name in CACHE_NAMES:
        if name in fields:
            return name
    raise UpstreamSignatureError(
        f"{output_class.__name__} has no field named {' or '.join(map(repr, CACHE_NAMES))}: hf_tpu cannot return the "
        "cache in it. Install a transformers release hf_tpu supports (pyproject.toml's range)."
    )
