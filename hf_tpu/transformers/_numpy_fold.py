"""``np.prod`` of known integers (a static tensor's shape) is a Python integer in a compiled graph, as it is in eager.

LLaVA-NeXT's ``pack_image_features`` (transformers 5.24, ``modeling_llava_next.py``; LLaVA-NeXT-Video's copy too)
checks its tiles' features against the tile grid with ``np.prod(image_feature.shape) % (...) != 0 and ...`` before a
warning. The shape is static in hf_tpu's vision graph, but torch 2.13's dynamo traces every numpy call into a tensor
op (``torch._numpy``; it folds only ``np.issubdtype`` on constants), so the ``and`` asks the truth of a traced tensor:
a data-dependent branch, and the image encoder could not be one graph. (With ``trace_numpy=False`` the call is
unsupported instead.)

The patched ``NumpyVariable.call_function`` computes ``np.prod`` on the host when every argument is a known
constant (static shapes, Python ints) and hands the graph the resulting integer, exactly eager's value; with a
symbolic or tensor argument (dynamic shapes, arrays) it calls upstream, which traces the call as before.
"""

from __future__ import annotations

import functools

from hf_tpu._patch import original, patch

__all__ = ["FOLDED", "apply"]

# the numpy functions computed on the host when their arguments are constants (names: ``numpy.NAME``)
FOLDED = ("prod",)


def apply(feature: str) -> None:
    import numpy as np

    try:
        from torch._dynamo.variables.constant import ConstantVariable
        from torch._dynamo.variables.misc import NumpyVariable
    except ImportError:  # pragma: no cover - a torch whose dynamo moved these classes
        return
    folded = tuple(getattr(np, name) for name in FOLDED)
    upstream = original(NumpyVariable, "call_function")

    @functools.wraps(upstream)
    def call_function(self, tx, args, kwargs):
        if self.value in folded and all(v.is_python_constant() for v in (*args, *kwargs.values())):
            value = self.value(*[a.as_python_constant() for a in args],
                               **{k: v.as_python_constant() for k, v in kwargs.items()})  # fmt: skip
            if isinstance(value, np.integer):  # (one number: a constant of the graph, as in eager)
                return ConstantVariable.create(int(value))
        return upstream(self, tx, args, kwargs)

    patch(NumpyVariable, "call_function", call_function, feature=feature, package="torch", versions=">=2.10,<2.14")
