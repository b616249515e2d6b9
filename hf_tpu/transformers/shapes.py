"""Shape planning: which prompt bucket and static-cache length a ``generate`` call runs in (:func:`plan_shapes`), what
a ladder costs (:func:`ladder_figures`), the id that fills a bucket's padding (:func:`fill_id`).

This public name stays; the planning lives with the loop every call runs, :mod:`hf_tpu.transformers._loops.skeleton`
(whose docstring says how a call's shapes are chosen).

Example:
    >>> plan_shapes(model, batch=1, prompt_len=500, max_new_tokens=8)      # doctest: +SKIP
    ShapePlan(batch=1, prompt_len=500, prompt_bucket=512, cache_bucket=640, encoder_bucket=None)
"""

from __future__ import annotations

from hf_tpu.transformers._loops.skeleton import LADDER_FIX, ShapePlan, fill_id, ladder_figures, plan_shapes

__all__ = ["LADDER_FIX", "ShapePlan", "fill_id", "ladder_figures", "plan_shapes"]
