"""The Config family: the seed's fields and defaults, and every validation rule."""

from __future__ import annotations

import dataclasses

import pytest

from esurge.config import (
    CacheConfig,
    Config,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
)


def sched(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = {"max_num_seqs": 8, "max_num_batched_tokens": 512,
                               "max_model_len": 512}
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def fields(cls: type) -> list[tuple[str, object]]:
    return [(f.name, f.default) for f in dataclasses.fields(cls)]


def test_seed_field_order_and_defaults() -> None:
    missing = dataclasses.MISSING
    assert fields(CacheConfig) == [
        ("num_pages", missing), ("page_size", missing), ("enable_prefix_caching", missing)]
    assert fields(SchedulerConfig) == [
        ("max_num_seqs", missing), ("max_num_batched_tokens", missing),
        ("max_model_len", missing), ("policy", "fcfs"), ("long_prefill_token_threshold", 256),
        ("chunked_prefill_enabled", False), ("token_safety_margin", None),
        ("max_num_seq_buckets", None), ("async_scheduling", False)]
    assert fields(SpeculativeConfig) == [
        ("num_speculative_tokens", 0), ("speculative_model", None)]
    assert fields(Config) == [
        ("scheduler_config", missing), ("cache_config", missing), ("speculative_config", None)]


def test_configs_are_frozen_with_slots() -> None:
    cfg = CacheConfig(num_pages=10, page_size=16, enable_prefix_caching=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 8  # type: ignore[misc]
    assert not hasattr(cfg, "__dict__")


def test_seed_example_constructs() -> None:
    config = Config(
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048,
                                         max_model_len=8192, policy="priority",
                                         chunked_prefill_enabled=True),
        cache_config=CacheConfig(num_pages=1000, page_size=16, enable_prefix_caching=True),
        speculative_config=SpeculativeConfig(num_speculative_tokens=5),
    )
    assert config.scheduler_config.scheduling_policy is SchedulingPolicy.PRIORITY
    assert config.num_speculative_tokens == 0  # no draft model: speculation stays off


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_pages": 0}, "num_pages"),
        ({"num_pages": -3}, "num_pages"),
        ({"num_pages": 2.5}, "num_pages"),
        ({"page_size": 0}, "page_size"),
        ({"page_size": True}, "page_size"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ],
)
def test_cache_config_rejects(kwargs: dict[str, object], field: str) -> None:
    base: dict[str, object] = {"num_pages": 4, "page_size": 16, "enable_prefix_caching": True}
    base.update(kwargs)
    with pytest.raises(ValueError, match=field) as err:
        CacheConfig(**base)  # type: ignore[arg-type]
    assert repr(kwargs[field]) in str(err.value)


def test_cache_config_num_pages_none_allowed() -> None:
    assert CacheConfig(num_pages=None, page_size=1, enable_prefix_caching=False).num_pages is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"policy": "lifo"}, "policy"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"token_safety_margin": -1}, "token_safety_margin"),
        ({"max_num_seq_buckets": (4, 4)}, "max_num_seq_buckets"),
        ({"max_num_seq_buckets": (8, 4)}, "max_num_seq_buckets"),
        ({"max_num_seq_buckets": (0, 4)}, "max_num_seq_buckets"),
        ({"max_num_seq_buckets": (4, 16)}, "max_num_seq_buckets"),
        ({"max_num_seq_buckets": ()}, "max_num_seq_buckets"),
        ({"chunked_prefill_enabled": 1}, "chunked_prefill_enabled"),
        ({"async_scheduling": None}, "async_scheduling"),
    ],
)
def test_scheduler_config_rejects(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        sched(**kwargs)


def test_budget_below_model_len_needs_chunked_prefill() -> None:
    with pytest.raises(ValueError) as err:
        sched(max_num_batched_tokens=256, max_model_len=512)
    assert "max_num_batched_tokens (256)" in str(err.value)
    assert "max_model_len (512)" in str(err.value)
    ok = sched(max_num_batched_tokens=256, max_model_len=512, chunked_prefill_enabled=True)
    assert ok.max_num_batched_tokens == 256


def test_buckets_normalised_to_tuple() -> None:
    assert sched(max_num_seq_buckets=[2, 4, 8]).max_num_seq_buckets == (2, 4, 8)


def test_speculative_rules() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="speculative_model"):
        SpeculativeConfig(num_speculative_tokens=0, speculative_model="/models/eagle")
    with pytest.raises(ValueError, match="speculative_model"):
        SpeculativeConfig(num_speculative_tokens=2, speculative_model="")


@pytest.mark.parametrize(
    ("k", "model", "expected"),
    [(0, None, False), (3, None, False), (3, "/m/eagle", True), (1, "/m/eagle", True)],
)
def test_use_eagle_truth_table(k: int, model: str | None, expected: bool) -> None:
    spec = SpeculativeConfig(num_speculative_tokens=k, speculative_model=model)
    assert spec.use_eagle() is expected


def test_config_checks_member_types() -> None:
    cache = CacheConfig(num_pages=4, page_size=16, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="scheduler_config"):
        Config(scheduler_config=cache, cache_config=cache)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="speculative_config"):
        Config(scheduler_config=sched(), cache_config=cache, speculative_config=3)  # type: ignore[arg-type]
    cfg = Config(sched(), cache, SpeculativeConfig(num_speculative_tokens=4, speculative_model="d"))
    assert cfg.num_speculative_tokens == 4
