"""How many of hf_tpu's files a text-only greedy ``generate`` passes through before its first compiled graph (issue
#49: the engine as one shape). Traced in a process of its own (tests/transformers/_engine_path.py), so lazy imports
and earlier tests change nothing.

Today's path: 12 files, issue #49's target (measured 2026-12-05; 28 before ``route.attempt``, the beam verdict carried
by the route, and one-use helper modules folded where they are used; 23 before the route carried the call's layout
and read-back reason, greedy search left the sampling package unasked, and the static cache, upstream's names and the
shape planning each became one module). The ceiling below keeps the path from growing: a change that adds a file to
it fails, one that removes files lowers the ceiling in the same commit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _timeouts import SAFETY_TIMEOUT_S

CEILING = 12
TARGET = 12  # issue #49
# Issue #66's measure: a warmed generate, every call counted until Dynamo runs its first compiled frame (run_graph's
# own path to the compiled function included). 12 files on 2026-12-08, the target (beyond the 12 above, less the
# probe: the environment table's read of HF_TPU_STRICT_COMPILE; 14 before the cache's reset stopped entering the
# layer classes (static.reset_cache) and run_graph stopped asking _module_state of a model that keeps no module state,
# 15 before the graph specs joined _graph_key).
WARMED_CEILING = 12
WARMED_TARGET = 12  # issue #66


def test_a_greedy_generate_reaches_its_first_graph_through_at_most_the_ceiling_of_files():
    script = Path(__file__).with_name("_engine_path.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = json.loads(proc.stdout.strip().splitlines()[-1])
    assert path["reached_a_graph"], "the traced generate ran no compiled graph"
    files = path["files"]
    listing = "\n".join(f"  {name}: {', '.join(functions)}" for name, functions in files.items())
    assert len(files) <= CEILING, f"{len(files)} files on the path (ceiling {CEILING}, target {TARGET}):\n{listing}"
    # the path starts at the entry hf_tpu.enable() installs (generation's own function) and the route is decided in
    # route.py
    assert "generate_on_tpu" in files.get("transformers/generation.py", ()), listing
    assert "transformers/route.py" in files, listing


def test_a_warmed_greedy_generate_reaches_dynamos_compiled_frame_through_at_most_the_ceiling_of_files():
    script = Path(__file__).with_name("_engine_path.py")
    proc = subprocess.run([sys.executable, str(script), "--warmed"], capture_output=True, text=True,
                          timeout=SAFETY_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = json.loads(proc.stdout.strip().splitlines()[-1])
    assert path["reached_a_graph"], "the traced generate never entered a compiled frame"
    files = path["files"]
    listing = "\n".join(f"  {name}: {', '.join(functions)}" for name, functions in files.items())
    assert len(files) <= WARMED_CEILING, (f"{len(files)} files on the warmed path (ceiling {WARMED_CEILING}, target "
                                          f"{WARMED_TARGET}):\n{listing}")  # fmt: skip
    assert "transformers/_graphs.py" in files and "run_graph" in files["transformers/_graphs.py"], listing
