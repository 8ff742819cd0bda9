"""A follower host of a multi-host engine: the leader's steps, on this host's devices.

`esurge-serve --host-rank R` (R > 0) runs `run_follower`: it joins the JAX
job, loads the same checkpoint, builds the same runner, warms it up (the
warm-up's collectives meet the leader's), then mirrors the leader's steps
(esurge.engine.multihost.lockstep.follow) until the leader stops it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from esurge.config import Config
from esurge.engine.api import default_config
from esurge.engine.compile_cache import enable_compile_cache
from esurge.engine.multihost.cluster import join_cluster
from esurge.engine.multihost.lockstep import check_multihost_config, connect_leader, follow
from esurge.errors import InvalidConfigError
from esurge.models.loader import load_model
from esurge.packaged import resolve_model_path
from esurge.runner.runner import eSurgeRunner
from esurge.settings import EngineSettings

__all__ = ["run_follower"]

log = logging.getLogger(__name__)


def run_follower(model_dir: str | Path, config: Config | None, settings: EngineSettings) -> None:
    """Serve as host settings.parallel_config.host_rank until the leader stops."""
    parallel = settings.parallel_config
    if not parallel.is_multihost or parallel.is_leader:
        raise InvalidConfigError("host_rank", f"run_follower needs a follower rank of a "
                                 f"multi-host job, got host_rank={parallel.host_rank} of "
                                 f"num_hosts={parallel.num_hosts}")
    enable_compile_cache()
    join_cluster(parallel)
    model_path = resolve_model_path(model_dir)
    model = load_model(model_path, settings.dtype,
                       tensor_parallel_size=parallel.tensor_parallel_size)
    config = config if config is not None else default_config(model)
    check_multihost_config(config, settings)
    # Before warm-up: the leader warms up once every follower has joined.
    link = connect_leader(model_path, config, settings)
    runner = eSurgeRunner(model, config, settings)
    runner.warmup()
    follow(runner, link)
    log.info("host %d: the leader stopped the job", parallel.host_rank)
