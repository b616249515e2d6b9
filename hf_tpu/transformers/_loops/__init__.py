"""hf_tpu's generation loops, every one in one package (private to :mod:`hf_tpu.transformers`).

Each loop is a ``custom_generate`` callable: upstream's ``generate`` prepares the call (its arguments, logits
processors, stopping criteria, streamer) and hands it to :func:`hf_tpu.transformers.generation.run_loop`, which runs
the loop of the call's route (decided once, in :mod:`hf_tpu.transformers.route`):

* :mod:`.skeleton`: what the cached loop and the loop without a cache share, written once
  (:class:`~.skeleton.LoopCall`: the sampling plan, each step's host side, the stopping criteria and the streamer,
  the output; the call's shapes, :func:`~.skeleton.plan_shapes`, beam's too); each of the two supplies only its
  layout and its graphs, and reads what its route decided (``route.layout``, ``route.read_back``) instead of asking
  again;
* :mod:`.defaults`: the plan of a call not made yet (the model's own ``generation_config``), for warm-up and
  :func:`hf_tpu.transformers.explain`;
* :mod:`.readback`: the new tokens kept on the device between read-backs;
* :mod:`.cached`: the route ``"cached"`` (the bucketed static cache: a prefill graph, then one decode graph per new
  token) and ``"host_length"`` (the same loop, its decode graph taking the cache length as a host number); also
  the warm-up of one shape plan;
* :mod:`.cacheless`: the route ``"cacheless"`` (no cache: each step runs the model over the whole sequence, padded
  to the bucket, in one graph), and the checks a model passes to take it;
* :mod:`.beam`: a beam call (``num_beams > 1``: the route says so, ``route.beams``) on either route above (its
  graphs run upstream's own beam step on the device), and what it cannot serve.

The route ``"upstream"`` has no loop here: upstream's own runs (:mod:`hf_tpu.transformers._upstream` says why).

Each loop module registers its :class:`~.skeleton.LoopSpec` once, at its end (:func:`~.skeleton.register_loop`: its
name, its ``custom_generate``, its warm-up); ``run_loop`` and :func:`hf_tpu.warmup` look the spec up by the route's
name (:func:`~.skeleton.route_spec`).

**A new loop** goes here as a module of its own: its ``custom_generate`` callable (``skeleton.loop(its_steps)``
where it shares the skeleton's shape), its warm-up and its one registration; a built-in one is imported by
:mod:`hf_tpu.transformers.generation`. Where no route takes it yet, its place in the routes' order is decided in
:mod:`hf_tpu.transformers.route`. The bodies of its graphs go into the graph table
(:mod:`hf_tpu.transformers._graphs`, whose ``run_graph`` runs every graph: strict mode, the persistent compile
cache), never here.
"""
