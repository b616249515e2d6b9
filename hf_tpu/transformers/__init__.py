"""hf_tpu's transformers integrations: generation on TPU (static cache, buckets, compiled graphs, warm-up).

Importing this package does not import transformers; the submodules do, when used. :func:`configure` (per-model
generation settings: ladder, cache sizing, strict mode, compile cache) is importable from here, as the error
messages name it.

Example:
    >>> from hf_tpu.transformers import configure
    >>> callable(configure)
    True
"""

from hf_tpu.transformers._settings import configure

__all__ = ["configure"]
