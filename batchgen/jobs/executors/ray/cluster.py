"""Connecting to Ray and sizing the actor pool.

`connect` joins the cluster RAY_ADDRESS names (`ray start --head` on the head node, `ray start
--address ...` on the others; `auto` finds a local `ray start` one), else starts a private local one
(never another job's: its driver would shut it down under us); a Ray already initialised in this process
(a notebook, the tests' `ray.init(num_cpus=2)`) is used as it is and left running.

Actors: on a cluster with GPUs, one per GPU (num_gpus=1 each), each holding its own model; on a
CPU-only cluster one per node, unless `--ray-actors N` asks for another count; each CPU actor gets an
equal share of the cluster's CPUs (at least one), which Ray exports as OMP_NUM_THREADS, so its torch
threads do not fight another actor's. The read tasks ask for no CPU of their own: they are light
(decoding Parquet) and would otherwise wait for CPUs the actors hold.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

from batchgen.errors import ConfigError

log = logging.getLogger("batchgen")


@dataclass(slots=True)
class ActorPlan:
    num_actors: int
    resources: dict[str, Any]  # ray_remote_args of each actor (num_gpus or num_cpus)
    reason: str


def connect(quiet: bool) -> bool:
    """Initialise Ray unless it already is; True when this call started it (the caller shuts it down)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--executor ray needs Ray Data: pip install 'batchgen[ray]'") from None
    if ray.is_initialized():
        return False
    # ray.init installs its own SIGTERM handler: the job's (batchgen.jobs.durability.signals) must stay in charge
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        # without RAY_ADDRESS a private local instance: never another job's, which its driver may shut down
        address = os.environ.get("RAY_ADDRESS") or "local"
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=not quiet, include_dashboard=False)
    finally:
        for signum, handler in handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
    return True


def plan_actors(requested: int | None) -> ActorPlan:
    import ray

    resources = ray.cluster_resources()
    num_gpus = int(resources.get("GPU", 0))
    num_cpus = int(resources.get("CPU", 0))
    if num_gpus:
        n = requested or num_gpus
        return ActorPlan(n, {"num_gpus": 1}, f"{n} GPU actor(s), one GPU each ({num_gpus} in the cluster)")
    if num_cpus < 1:
        raise ConfigError("the Ray cluster has no CPUs or GPUs to run actors on")
    nodes = [node for node in ray.nodes() if node.get("Alive") and node.get("Resources", {}).get("CPU")]
    n = requested or max(1, len(nodes))
    per_actor = max(1, num_cpus // n)
    return ActorPlan(n, {"num_cpus": per_actor},
                     f"{n} CPU actor(s), {per_actor} CPU(s) each ({num_cpus} CPUs on {len(nodes)} node(s))")
