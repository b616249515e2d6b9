"""The safety timeout of every subprocess a test starts (tests/ is on ``sys.path`` through tests/conftest.py).

It catches a child that hangs (a rank waiting on a peer that died, libtpu waiting for a metadata server), never a
slow machine: the same suite takes 7.5 minutes on an idle 2-core host and 40 on a busy one, so no test waits on a
fixed short timeout around real work. pytest-timeout (``timeout`` in pyproject.toml) is a larger last resort, so
that the subprocess timeout fires first and the test kills its child cleanly and shows its output.
"""

#: Seconds a subprocess may run before the test calls it hung (and kills it).
SAFETY_TIMEOUT_S = 1500
