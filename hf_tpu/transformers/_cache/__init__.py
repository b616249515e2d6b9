"""The cache of hf_tpu's generation loop, every piece in one package (private to :mod:`hf_tpu.transformers`).

What lives where, and where a new piece goes:

* :mod:`.static`: the static cache's layout: the registry from upstream's static cache layer class to its bucketed
  form, and ``NO_STATIC_FORM`` for the layer kinds that have none; the model's caches built from them, one per
  (batch, cache length, encoder length, dtype) shape, reset and reused across calls; the check that a model's cache
  can be bucketed at all; what the loops tell its layers on the host (the host length, prefill or decode); and the
  patch by which upstream's sdpa mask takes the 2D mask's padding as a slice on a tpu device (kept with what a
  ``generate`` call runs before its first graph, which the probe's forward calls).
  **A new layer kind** of upstream's (a new ``transformers.cache_utils`` layer class) gets its bucketed class in
  :mod:`.layer_classes` and one entry in the registry; **a layer kind with no static form** gets an entry in
  ``NO_STATIC_FORM`` with the reason generate names when it runs upstream's loop instead.
* :mod:`.writes`: where a decode step writes its new K/V rows (``HF_TPU_KV_WRITE``: in the graph, or after it by
  one program for every layer, ``HF_TPU_KV_ROWS_WRITER``).
* :mod:`.masks`: the 2D masks the compiled graphs hand the model (a prefill's, a decode step's with the columns a
  sliding-window ring reads).
* :mod:`.layer_classes`: the bucketed layer classes themselves (module level: the persistent compile cache refers to
  them by name).
* :mod:`.model_classes`: bucketed forms of **a model's own cache class** (a model that does not take upstream's
  ``StaticCache``); a new one goes here, keyed by that class.
* :mod:`.probe` (with :mod:`.probe_cpu` and :mod:`.probe_error`): the shapes a model's layers write, measured once
  per model on the ``meta`` device, else on the CPU with weights that take no memory.
* :mod:`.module_swaps`: models whose first forward replaces some of their own modules, settled before the probe
  measures them.
* :mod:`.handoff`: the cache in and out of a call (a cache the caller passes, the cache a call returns).

Nothing here is public API: :mod:`hf_tpu.transformers` is the room's front door.
"""
