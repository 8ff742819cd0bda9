"""Rejection at add_request, constructor validation and from_runner."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from esurge.core import SlidingWindowSpec
from esurge.core.kv_cache_spec import cache_groups_from_hf_config
from esurge.engine_types import EngineCoreEventType
from esurge.errors import InvalidRequestError
from esurge.request import EngineRequestStatus
from esurge.scheduler import Scheduler, SchedulerInterface
from tests.scheduler.fakes import make_config, make_request, make_scheduler, run


def test_prompt_plus_max_tokens_beyond_max_model_len_is_rejected() -> None:
    s = make_scheduler(max_model_len=32, max_num_batched_tokens=32)
    with pytest.raises(InvalidRequestError, match=r"'big'.*\(20\).*\(13\) = 33.*max_model_len=32"
                       ) as info:
        s.add_request(make_request("big", 20, 13))
    assert info.value.field == "sampling_params.max_tokens"
    s.add_request(make_request("ok", 20, 12))
    assert s.get_request_counts() == (0, 1)


def test_prompt_without_room_is_rejected_when_max_tokens_is_none() -> None:
    s = make_scheduler(max_model_len=32, max_num_batched_tokens=32)
    with pytest.raises(InvalidRequestError, match=r"'p'.*32 tokens.*max_model_len=32") as info:
        s.add_request(make_request("p", 32, None))
    assert info.value.field == "prompt"  # no max_tokens could make it fit
    with pytest.raises(InvalidRequestError, match=r"'p'.*33 tokens") as info:
        s.add_request(make_request("p", 33, 4))
    assert info.value.field == "prompt"
    s.add_request(make_request("q", 31, None))


def test_request_beyond_the_whole_cache_is_rejected() -> None:
    # 4 usable pages of 4 hold 16 tokens of KV; the last output token needs none.
    s = make_scheduler(num_pages=5)
    with pytest.raises(InvalidRequestError, match=r"'r'.*17 tokens of KV need 5 pages.*only 4"
                       ) as info:
        s.add_request(make_request("r", 8, 10))
    assert info.value.field == "sampling_params.max_tokens"
    with pytest.raises(InvalidRequestError) as info:
        s.add_request(make_request("r", 17, 1))  # the prompt alone needs 5 pages
    assert info.value.field == "prompt"
    s.add_request(make_request("fits", 8, 9, ignore_eos=True))
    got = run(s)
    assert len(got.tokens["fits"]) == 9
    assert s.get_num_unfinished_requests() == 0


def test_duplicate_live_request_id_is_rejected_until_it_ends() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 4, 2))
    with pytest.raises(InvalidRequestError, match="'a' is already in use") as info:
        s.add_request(make_request("a", 4, 2))
    assert info.value.field == "request_id"
    run(s)
    s.add_request(make_request("a", 4, 2))
    assert s.get_request_counts() == (0, 1)


def test_a_request_that_already_ran_is_rejected() -> None:
    s = make_scheduler()
    r = make_request("a", 4, 2)
    r.status = EngineRequestStatus.RUNNING
    with pytest.raises(ValueError, match="must be new"):
        s.add_request(r)


def test_add_request_records_queued() -> None:
    s = make_scheduler()
    r = make_request("a", 4, 2)
    s.add_request(r)
    assert [e.type for e in r.events] == [EngineCoreEventType.QUEUED]
    assert s.get_num_unfinished_requests() == 1 and s.has_unfinished_requests()


def test_constructor_validation() -> None:
    config, groups = make_config(page_size=4)
    other_config, other_groups = make_config(page_size=8)
    with pytest.raises(ValueError, match="page_size"):
        Scheduler(config, other_groups)
    _, fewer_pages = make_config(num_pages=10)
    with pytest.raises(ValueError, match="num_pages"):
        Scheduler(config, fewer_pages)
    with pytest.raises(ValueError, match="config must be a Config"):
        Scheduler(other_config.scheduler_config, groups)  # type: ignore[arg-type]
    assert isinstance(Scheduler(config, groups), SchedulerInterface)


def test_from_runner_takes_the_runners_cache_groups() -> None:
    from transformers import MistralConfig

    hf = MistralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                       sliding_window=16)
    config, _ = make_config(page_size=4, num_pages=64, max_model_len=64,
                            max_num_batched_tokens=64)
    # What eSurgeRunner holds: the groups the loader detected from the model's config.
    groups = cache_groups_from_hf_config(hf, 33, 4, "bfloat16")
    runner = SimpleNamespace(config=config, cache_groups=groups, max_model_len=48,
                             decode_steps=1)
    s = Scheduler.from_runner(runner, max_num_batched_tokens=96, enable_prefix_caching=False)
    kv = s.kv_cache_manager
    assert (kv.num_usable_pages, kv.num_groups, kv.page_size) == (32, 1, 4)
    assert (s.max_model_len, s.max_num_batched_tokens) == (48, 96)
    assert s.config.cache_config.num_pages == 33
    assert s.config.cache_config.enable_prefix_caching is False
    assert s.kv_cache_config is groups
    (group,) = s.kv_cache_config.groups
    assert group.layer_ids == (0, 1)
    assert group.spec == SlidingWindowSpec(page_size=4, num_kv_heads=2, head_dim=8,
                                           dtype="bfloat16", sliding_window=16)
    default = Scheduler.from_runner(runner)
    assert default.max_num_batched_tokens == 64  # runner.config's budget is kept
    assert default.config.cache_config.enable_prefix_caching is True


def test_each_step_says_how_many_requests_still_wait() -> None:
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 4, 3))
    out = s.schedule()
    assert (len(out.scheduled_new_reqs), out.num_waiting_reqs) == (2, 3)
