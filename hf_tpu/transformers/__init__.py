"""hf_tpu's transformers integrations: generation on TPU (static cache, buckets, compiled graphs, warm-up).

Importing this package does not import transformers; the submodules do, when used. :func:`configure` (per-model
generation settings: ladder, cache sizing, strict mode, compile cache) is importable from here, as the error
messages name it; :func:`explain` says which loop a ``generate`` call takes and why
(:mod:`hf_tpu.transformers.route`).

Example:
    >>> from hf_tpu.transformers import configure
    >>> callable(configure)
    True
"""

from hf_tpu.transformers._settings import Route, configure

__all__ = ["Route", "configure", "explain"]


def explain(model, **generate_kwargs) -> Route:
    """Which loop ``model.generate(**generate_kwargs)`` runs, and why (:func:`hf_tpu.transformers.route.explain`).

    Args:
        model: a ``PreTrainedModel`` with ``GenerationMixin``.
        **generate_kwargs: what the ``generate`` call would get.

    Returns:
        A :class:`Route`: ``loop`` (``"cached"``, ``"host_length"``, ``"cacheless"`` or ``"upstream"``),
        ``reason``, ``warn``, ``host_sampling``, ``step_by_step``.

    Raises:
        Nothing of its own: arguments upstream rejects give an ``"upstream"`` route (``generate`` raises there).
    """
    from hf_tpu.transformers.route import explain as _explain

    return _explain(model, **generate_kwargs)
