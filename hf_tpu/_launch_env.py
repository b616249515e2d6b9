"""The launch environment of simulated TPU chips: what ``hf-tpu launch --simulate`` (:mod:`hf_tpu.distributed.launch`)
sets for its ranks, and what the simulator's ``torch.tpu.distributed.set_tpu_launch_env``
(:mod:`hf_tpu.sim._public_api`) sets for torch_tpu's own launch recipe.

It lives below both, so that the simulator (the bottom room) imports nothing from :mod:`hf_tpu.distributed`;
:mod:`hf_tpu.distributed.launch` re-exports every public name here, and is where to import them from.
"""

from __future__ import annotations

import os
import socket
import time

from hf_tpu.errors import UserError

__all__ = ["SIM_DEFAULT_GENERATION", "LaunchError", "set_simulated_launch_env", "simulated_topology"]

# The simulator's generation when none is asked for (hf_tpu.distributed.launch falls back to another generation for
# a process count v6e has no mesh for).
SIM_DEFAULT_GENERATION = "v6e"


class LaunchError(UserError, RuntimeError):
    """The launch cannot start: what was asked, what was found, and what to do."""


def simulated_topology(nproc: int, generation: str = SIM_DEFAULT_GENERATION) -> str:
    """The ``TORCH_TPU_TOPOLOGY`` torch_tpu sets for ``nproc`` devices of ``generation`` (``"2,2,1"`` for 4).

    Args:
        nproc: the number of TPU devices (processes) on the host.
        generation: a key of :data:`hf_tpu.runtime.GENERATIONS`; the simulator's default generation unless given.

    Returns:
        The topology string, as torch_tpu's table gives it.

    Raises:
        LaunchError: torch_tpu has no mesh for ``nproc`` on ``generation``; the message names the counts that work.
    """
    from hf_tpu import _torch_tpu

    try:
        return _torch_tpu.topology(generation, nproc)
    except _torch_tpu.UnsupportedTopologyError as err:
        raise LaunchError(str(err)) from None


def is_multihost(nnodes: int | None, env) -> bool:
    """torch_tpu's rule: ``nnodes > 1``, two or more ``TPU_WORKER_HOSTNAMES``, or ``JOB_COMPLETION_INDEX`` set."""
    return (nnodes is not None and nnodes > 1) or len(_worker_hostnames(env)) > 1 or "JOB_COMPLETION_INDEX" in env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _worker_hostnames(env: os._Environ | dict) -> list[str]:
    return [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]


def set_simulated_launch_env(
    *,
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
    env: dict | None = None,
    generation: str = SIM_DEFAULT_GENERATION,
) -> dict[str, str]:
    """The simulated counterpart of torch_tpu's ``set_tpu_launch_env``: same variables, same rules.

    Never overwrites a variable that is already set (so an operator can pin any of them). Multi-host is detected
    as torch_tpu does: ``nnodes > 1``, two or more ``TPU_WORKER_HOSTNAMES``, or ``JOB_COMPLETION_INDEX`` set.
    The simulated host has ``nproc_per_node`` devices of ``generation``: a count torch_tpu has no mesh for raises
    :class:`LaunchError` (torch_tpu's ``get_tpu_topology`` raises RuntimeError there). Every rank also gets
    ``HF_TPU_SIMULATE=1`` and ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (torch_tpu must not initialise a device on a
    host without chips). Returns the variables this call set.

    Args:
        nnodes: the number of hosts (``--nnodes``); None: one, unless the environment says multi-host.
        nproc_per_node: devices (processes) per simulated host; None: 1.
        env: the environment to fill; None (the default) is ``os.environ``.
        generation: the simulated TPU generation; the simulator's default unless given.

    Returns:
        The variables this call set, with their values.

    Raises:
        LaunchError: no mesh for ``nproc_per_node`` on ``generation``, ``nnodes`` that disagrees with
            ``TPU_WORKER_HOSTNAMES``, or a multi-host launch without the hostnames or this host's rank.

    Example:
        >>> env = {}
        >>> set_simulated_launch_env(nproc_per_node=4, env=env)["TORCH_TPU_TOPOLOGY"]
        '2,2,1'
    """
    env = os.environ if env is None else env
    count = nproc_per_node or 1
    mesh = simulated_topology(count, generation)  # refuse before changing anything
    before = dict(env)

    def once(name: str, value) -> None:
        if name not in env:
            env[name] = str(value() if callable(value) else value)

    once("HF_TPU_SIMULATE", "1")
    once("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    once("TORCH_TPU_XPROF_SESSION_ID", lambda: str(time.time_ns()))
    hosts = _worker_hostnames(env)
    if nnodes is not None and hosts and nnodes != len(hosts):
        raise LaunchError(
            f"--nnodes={nnodes} was asked, but TPU_WORKER_HOSTNAMES lists {len(hosts)} host(s) "
            f"({env['TPU_WORKER_HOSTNAMES']!r}); pass --nnodes={len(hosts)} or fix TPU_WORKER_HOSTNAMES."
        )
    completion_index = env.get("JOB_COMPLETION_INDEX")
    if is_multihost(nnodes, env):
        if not hosts:
            raise LaunchError(
                "a multi-host launch was asked (--nnodes > 1 or JOB_COMPLETION_INDEX set), but "
                "TPU_WORKER_HOSTNAMES is unset; set it to the comma-separated worker hostnames, the first being "
                "the rendezvous host (e.g. TPU_WORKER_HOSTNAMES=host0,host1)."
            )
        base_port = int(env.get("TORCH_TPU_BASE_PORT", "8070"))
        per_host = int(env.get("TORCH_TPU_DEVICES_PER_HOST", count))
        once(
            "TORCH_TPU_SLICEBUILDER_ADDRESSES",
            ",".join(f"{h}:{base_port + i}" for h in hosts for i in range(per_host)),
        )
        once("NNODES", nnodes if nnodes is not None else len(hosts))
        if "NODE_RANK" not in env:
            if completion_index is None:
                raise LaunchError(
                    "a multi-host launch needs this host's rank: pass --node_rank, or set NODE_RANK or "
                    "JOB_COMPLETION_INDEX (Kubernetes Indexed Jobs set it)."
                )
            env["NODE_RANK"] = str(int(completion_index))
        once("MASTER_ADDR", hosts[0])
        once("MASTER_PORT", "29500")
        once("TORCH_TPU_TOPOLOGY", mesh)
    else:
        once("TORCH_TPU_SLICEBUILDER_ADDRESSES", lambda: ",".join(f"localhost:{free_port()}" for _ in range(count)))
        once("TORCH_TPU_TOPOLOGY", mesh)
    return {k: v for k, v in env.items() if before.get(k) != v}


def slice_mismatch(env: os._Environ | dict) -> str | None:
    """In a rank torchrun started: a message when the launch environment describes a different number of devices
    on this host than torchrun started processes, else None.

    torch_tpu's ``set_tpu_launch_env()`` with no ``nproc_per_node`` describes every chip of the host (a 4-chip
    host: ``TORCH_TPU_TOPOLOGY=2,2,1`` and 4 slice-builder addresses) whatever torchrun's ``--nproc_per_node``
    says afterwards (torch-tpu 0.2.0, ``_internal/distributed/distributed.py``); ``hf_tpu.sim``'s stand-in does the
    same. Two ranks in a four-device slice is a launch mistake on a TPU VM: this names it and the call that fixes
    it, on the simulator as well.
    """
    addresses = [a for a in env.get("TORCH_TPU_SLICEBUILDER_ADDRESSES", "").split(",") if a]
    local_world = env.get("LOCAL_WORLD_SIZE")
    if not addresses or not local_world or not local_world.isdigit():
        return None
    nnodes = int(env.get("NNODES") or env.get("GROUP_WORLD_SIZE") or 1)
    per_host = len(addresses) // max(nnodes, 1)
    ranks = int(local_world)
    if per_host == ranks:
        return None
    return (
        f"this host's launch environment describes {per_host} TPU devices (TORCH_TPU_TOPOLOGY="
        f"{env.get('TORCH_TPU_TOPOLOGY', '?')}, {per_host} slice-builder addresses) but torchrun started {ranks} "
        f"process(es) here: call torch.tpu.distributed.set_tpu_launch_env(nproc_per_node={ranks}) before torchrun's "
        f"main (torch_tpu then describes a {ranks}-device slice, or refuses a count the TPU generation has no "
        "layout for), or use hf-tpu launch, which passes it"
    )
