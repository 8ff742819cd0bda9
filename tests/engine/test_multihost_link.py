"""The multi-host step channel on loopback: handshake, digests, a follower that leaves."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from esurge.config import CacheConfig, Config, ParallelConfig, SchedulerConfig
from esurge.engine.multihost.fingerprint import differences, fingerprint
from esurge.engine.multihost.link import FollowerLink, HandshakeError, LeaderLink, LinkError
from esurge.errors import InvalidConfigError
from esurge.settings import EngineSettings


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pair(leader_fp: dict[str, str], follower_fp: dict[str, str]
          ) -> tuple[LeaderLink | BaseException, FollowerLink | BaseException]:
    address = ("127.0.0.1", _port())
    out: dict[str, LeaderLink | BaseException] = {}

    def lead() -> None:
        try:
            out["leader"] = LeaderLink(address, 1, leader_fp, timeout_s=20)
        except BaseException as err:
            out["leader"] = err

    thread = threading.Thread(target=lead)
    thread.start()
    try:
        follower: FollowerLink | BaseException = FollowerLink(address, 1, follower_fp,
                                                              timeout_s=20)
    except BaseException as err:
        follower = err
    thread.join(20)
    return out["leader"], follower


def _wait(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_different_fingerprint_is_refused_on_both_ends() -> None:
    leader, follower = _pair({"model": "a", "config.x": "1"}, {"model": "a", "config.x": "2"})
    assert isinstance(leader, HandshakeError) and isinstance(follower, HandshakeError)
    assert leader.differences == follower.differences == ["config.x: 1 vs 2"]
    assert leader.rank == 1 and "host 1 does not match the leader" in str(leader)


def test_digests_that_differ_fail_the_link_naming_host_and_step() -> None:
    leader, follower = _pair({"a": "1"}, {"a": "1"})
    assert isinstance(leader, LeaderLink) and isinstance(follower, FollowerLink)
    told: list[LinkError] = []
    leader.on_failure = told.append
    leader.record(0, "same")
    follower.send_digest(0, "same")
    follower.send_digest(1, "theirs")
    leader.record(1, "mine")
    _wait(lambda: told)
    assert "host 1 diverged at step 1" in str(told[0]) and leader.failure is told[0]
    with pytest.raises(LinkError):
        leader.send(("collect",))
    follower.close()
    leader.close()


def test_a_follower_that_hangs_up_fails_the_link() -> None:
    leader, follower = _pair({"a": "1"}, {"a": "1"})
    assert isinstance(leader, LeaderLink) and isinstance(follower, FollowerLink)
    leader.send(("dispatch", "step 0"))
    assert follower.receive() == ("dispatch", "step 0")
    follower.close()
    _wait(lambda: leader.failure is not None)
    assert "host 1 left the job" in str(leader.failure)
    leader.close()


def test_the_fingerprint_names_config_settings_and_weights(tmp_path: Path) -> None:
    for name, fill in (("a", b"\0"), ("b", b"\1")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "model.safetensors").write_bytes(fill * 300_000)
    config = Config(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=16),
                    CacheConfig(num_pages=8, page_size=8, enable_prefix_caching=True))
    job = ParallelConfig(2, num_hosts=2, host_rank=0, coordinator_address="127.0.0.1:1234")
    leader = fingerprint(tmp_path / "a", config, EngineSettings(parallel_config=job))
    same = fingerprint(tmp_path / "a", config, EngineSettings(
        parallel_config=ParallelConfig(2, num_hosts=2, host_rank=1,
                                       coordinator_address="127.0.0.1:1234")))
    assert differences(leader, same) == []  # the rank is meant to differ
    other = fingerprint(tmp_path / "b", config, EngineSettings(dtype="bfloat16",
                                                               parallel_config=job))
    assert [d.split(":")[0] for d in differences(leader, other)] == ["model", "settings.dtype"]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"num_hosts": 2}, "coordinator_address"),
    ({"num_hosts": 2, "coordinator_address": "nohost"}, "coordinator_address"),
    ({"num_hosts": 2, "host_rank": 2, "coordinator_address": "h:1"}, "host_rank"),
    ({"num_hosts": 2, "tensor_parallel_size": 3, "coordinator_address": "h:1"},
     "tensor_parallel_size"),
    ({"coordinator_address": "h:1"}, "coordinator_address"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
])
def test_parallel_config_names_the_bad_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidConfigError) as err:
        ParallelConfig(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


def test_the_leaders_own_close_is_no_failure() -> None:
    leader, follower = _pair({"a": "1"}, {"a": "1"})
    assert isinstance(leader, LeaderLink) and isinstance(follower, FollowerLink)
    told: list[LinkError] = []
    leader.on_failure = told.append
    leader.close()
    assert follower.receive() == ("stop",)
    follower.close()
    time.sleep(0.3)
    assert told == [] and leader.failure is None


@pytest.mark.parametrize(("speculation", "spec", "pages", "field"), [
    ("adaptive", True, 8, "speculation"),  # each host would decide by its own timings
    ("always", True, 8, None),
    ("adaptive", False, 8, None),
    ("always", True, None, "num_pages"),
])
def test_multihost_configs_every_host_builds_and_decides_alike(
        speculation: str, spec: bool, pages: int | None, field: str | None) -> None:
    from esurge.config import SpeculativeConfig
    from esurge.engine.multihost.lockstep import check_multihost_config

    config = Config(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
                    CacheConfig(num_pages=pages, page_size=8, enable_prefix_caching=False),
                    SpeculativeConfig(4, "models/tiny-stdlib-eagle") if spec else None)
    settings = EngineSettings(speculation=speculation)
    if field is None:
        check_multihost_config(config, settings)
        return
    with pytest.raises(InvalidConfigError) as err:
        check_multihost_config(config, settings)
    assert err.value.field == field
