"""The project's benchmarks, shipped with the package and run by ``hf-tpu bench``.

Each benchmark is a module ``hf_tpu.benchmarks.<name>`` with:

- ``add_arguments(parser)``: its options (sizes, iterations, threads);
- ``QUICK``: option defaults for ``--quick`` (small sizes, few iterations; options given explicitly still win);
- ``run(args) -> dict``: measures and returns the figures as plain JSON-able data;
- ``print_table(figures)``: prints them as the benchmark's table.

``python -m hf_tpu.benchmarks NAME`` (:mod:`hf_tpu.benchmarks.__main__`) parses, runs and prints one of them; the
scripts ``benchmarks/<name>.py`` of a checkout call it.

Every figure is measured side by side in one run (a ratio of two things measured together, or counters of the
simulated device), never against a stored number. :data:`BENCHMARKS` lists them without importing them, so
``hf-tpu bench --list`` stays fast.

Example:
    >>> from hf_tpu.benchmarks import BENCHMARKS, load
    >>> sorted(BENCHMARKS)[:2]
    ['arch_sweep', 'compile_cache']
    >>> load("sim_forward").QUICK["iters"]  # doctest: +SKIP
    5
"""

from __future__ import annotations

from hf_tpu.benchmarks._registry import BENCHMARKS, Benchmark, load, missing_requirements

__all__ = ["BENCHMARKS", "Benchmark", "load", "missing_requirements"]
