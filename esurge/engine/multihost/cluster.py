"""Joining the JAX job: jax.distributed under the engine, before JAX's backend starts."""

from __future__ import annotations

import logging

from esurge.config import ParallelConfig

__all__ = ["join_cluster"]

log = logging.getLogger(__name__)


def join_cluster(parallel: ParallelConfig, timeout_s: int = 300) -> None:
    """jax.distributed.initialize for this host (a no-op on one host).

    Must run before anything touches a JAX device. On CPU the cross-process
    collectives go through gloo.
    """
    if not parallel.is_multihost:
        return
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(parallel.coordinator_address, num_processes=parallel.num_hosts,
                               process_id=parallel.host_rank, initialization_timeout=timeout_s)
    log.info("host %d of %d joined the job at %s: %d local device(s) of %d",
             parallel.host_rank, parallel.num_hosts, parallel.coordinator_address,
             jax.local_device_count(), jax.device_count())
