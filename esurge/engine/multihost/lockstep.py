"""Running one engine's steps on every host of a job, in the same order.

`LockstepExecutor` is the leader's `ModelExecutor`: it tells the followers
each dispatch (with its SchedulerOutput) and each collect before doing it
itself, and checks every collected step's digest against theirs.
`follow` is a follower's whole life after warm-up: mirror those calls on
its own runner until told to stop. Both runners start identical (same
fingerprint) and see the same SchedulerOutputs, so their persistent batches,
their programs and the collectives inside them stay in step.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from esurge.config import Config
from esurge.engine.multihost.fingerprint import fingerprint
from esurge.engine.multihost.link import FollowerLink, LeaderLink, LinkError, step_address
from esurge.errors import InvalidConfigError
from esurge.outputs import ModelRunnerOutput
from esurge.scheduler.output import SchedulerOutput
from esurge.settings import EngineSettings

__all__ = ["LockstepExecutor", "check_multihost_config", "connect_followers", "connect_leader",
           "follow", "step_digest"]

log = logging.getLogger(__name__)


def step_digest(out: ModelRunnerOutput) -> str:
    """A short digest of what a step sampled (ids, tokens, drafts)."""
    text = repr((out.req_ids, out.sampled_token_ids, out.spec_token_ids))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def check_multihost_config(config: Config, settings: EngineSettings) -> None:
    """Refuse what every host could not build or decide alike: a pool sized from
    each host's own free memory, and speculation chosen by each host's timings."""
    if config.cache_config.num_pages is None:
        raise InvalidConfigError("num_pages", "multi-host serving needs num_pages set: a pool "
                                 "sized from free memory could differ between hosts")
    spec = config.speculative_config
    if spec is not None and spec.use_eagle() and settings.speculation != "always":
        # Each host would draft or not by its own step costs and timings, and
        # the hosts' steps would part (the digests differ: the job ends).
        raise InvalidConfigError("speculation", f"multi-host serving with a draft head needs "
                                 f"speculation='always', got {settings.speculation!r}: the "
                                 f"adaptive policy decides from each host's own timings")


def connect_followers(model_path: Path, config: Config, settings: EngineSettings
                      ) -> LeaderLink:
    """The leader's step channel, once every follower joined with a matching fingerprint."""
    parallel = settings.parallel_config
    address = step_address(parallel.coordinator_address or "")
    return LeaderLink(address, parallel.num_hosts - 1, fingerprint(model_path, config, settings))


class LockstepExecutor:
    """The leader's executor: the runner's dispatch and collect, mirrored on every host."""

    def __init__(self, runner: Any, link: LeaderLink) -> None:
        self.runner = runner
        self.link = link
        self._collected = itertools.count()

    def dispatch(self, scheduler_output: SchedulerOutput) -> Any:
        """Send the step to the followers, then start it here."""
        self.link.send(("dispatch", scheduler_output))
        return self.runner.dispatch(scheduler_output)

    def collect(self, pending: Any) -> ModelRunnerOutput:
        """Collect here and on the followers; LinkError once a follower left or diverged."""
        self.link.send(("collect",))
        out: ModelRunnerOutput = self.runner.collect(pending)
        self.link.record(next(self._collected), step_digest(out))
        if self.link.failure is not None:
            raise self.link.failure
        return out

    def pipelines(self, pending: Any) -> bool:
        """The runner's answer: the followers run the same kinds of steps."""
        return bool(self.runner.pipelines(pending))

    def drafts_ahead(self, pending: Any) -> dict[str, Any]:
        """The runner's (none across hosts: see eSurgeRunner.hands_drafts_ahead)."""
        return dict(self.runner.drafts_ahead(pending))

    def resyncs(self) -> dict[str, int]:
        """None across hosts (see eSurgeRunner.resyncs_heads)."""
        return {}

    def rewound(self, computed: Mapping[str, int]) -> None:
        """Nothing moves back across hosts."""

    def shutdown(self) -> None:
        """Release the followers."""
        self.link.close()


def connect_leader(model_path: Path, config: Config, settings: EngineSettings) -> FollowerLink:
    """A follower's step channel, once the leader accepted its fingerprint
    (HandshakeError naming every difference when refused)."""
    parallel = settings.parallel_config
    return FollowerLink(step_address(parallel.coordinator_address or ""), parallel.host_rank,
                        fingerprint(model_path, config, settings))


def follow(runner: Any, link: FollowerLink) -> None:
    """Mirror the leader's steps until it says stop (LinkError when it goes away)."""
    log.info("host %d follows the leader's steps", link.rank)
    pending: deque[Any] = deque()
    steps = itertools.count()
    try:
        while True:
            message = link.receive()
            if message[0] == "dispatch":
                pending.append(runner.dispatch(message[1]))
            elif message[0] == "collect":
                link.send_digest(next(steps), step_digest(runner.collect(pending.popleft())))
            elif message[0] == "stop":
                return
            else:
                raise LinkError(f"unknown step message {message[0]!r}")
    finally:
        link.close()
