"""Models whose forward replaces some of their own modules the first time it runs, and keeps them after.

BigBird's block-sparse attention swaps itself for full attention (new modules holding the same weights) when its
input is short or it is given a cache: upstream's first ``generate`` does exactly that to the user's model. A
compiled graph cannot build modules, so hf_tpu lets the model take that step before its first trace. The cache probe
(:mod:`~hf_tpu.transformers._cache.probe`) sees its copy's forward replace modules, runs the copy again and requires
the second forward to keep every module it found (a forward that replaces modules on every run stays on upstream's
loop, with that reason); then the real model runs the same forward once, eagerly on its own device, on two tokens,
and must end with the module classes the copy settled into. No module is built by hf_tpu: the model's own forward
swaps them, as it would at upstream's first ``generate`` (and logs what upstream logs then).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hf_tpu.transformers._cache.probe_error import CacheProbeError

__all__: list[str] = []

logger = logging.getLogger("hf_tpu.generation")

Replaced = list[tuple[str, type, type]]  # (module name, class before, class after)


def _kept_every_module(before: dict, module) -> bool:
    now = dict(module.named_modules())
    return now.keys() == before.keys() and all(now[name] is old for name, old in before.items())


def describe(model, replaced: Replaced) -> str:
    name, old, new = replaced[0]
    return (
        f"the forward of {type(model).__name__} replaces {len(replaced)} of its own modules when it runs ({name}: "
        f"{old.__name__} -> {new.__name__})"
    )


def second_forward_keeps_modules(model, probe, replaced: Replaced, forward: Callable[[], object]):
    """Run ``forward`` (the probe's, on ``probe``, a copy of ``model`` whose first forward replaced modules) again and
    return what it returns; raise ``CacheProbeError`` unless it kept every module the first one left."""
    settled = dict(probe.named_modules())
    result = forward()
    if not _kept_every_module(settled, probe):
        raise CacheProbeError(
            f"{describe(model, replaced)}, and again on every later run, which a compiled graph cannot do"
        )
    return result


def settle(model, replaced: Replaced, forward: Callable[[], object]) -> None:
    """Let ``model`` replace its modules as its copy did: run ``forward`` (the same forward, on ``model`` and its
    device) once unless the modules already are the settled ones; raise ``CacheProbeError`` if they are not after."""
    modules = dict(model.named_modules())
    if all(type(modules.get(name)) is new for name, _, new in replaced):
        return  # settled already (an earlier forward or generate of the user's)
    logger.info(
        "hf_tpu: %s; running it once on two tokens on %s before the first compiled graph, as upstream's first "
        "generate would (the model keeps the new modules, with the same weights)", describe(model, replaced),
        model.device,
    )  # fmt: skip
    forward()
    modules = dict(model.named_modules())
    wrong = [(name, new) for name, _, new in replaced if type(modules.get(name)) is not new]
    if wrong:
        name, new = wrong[0]
        raise CacheProbeError(
            f"{describe(model, replaced)} on a copy, but one run of the model left {name} a "
            f"{type(modules.get(name)).__name__}, not the {new.__name__} its copy settled into"
        )
