"""SamplingParams validation, request status ordering and finish-reason mapping."""

from __future__ import annotations

import pytest

from esurge.engine_types import EngineCoreEventType, FinishReason
from esurge.outputs import ModelRunnerOutput, TokenLogprobs
from esurge.request import EngineRequest, EngineRequestStatus
from esurge.sampling_params import MAX_N, SamplingParams

S = EngineRequestStatus


def test_sampling_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, None, 0.0)
    assert (p.max_tokens, p.min_tokens, p.repetition_penalty) == (16, 0, 1.0)
    assert p.stop == () and p.logprobs is None and p.skip_special_tokens is True
    assert not p.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(n=MAX_N).n == MAX_N == 1024


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 1025}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1e31}, "temperature"),  # the float32 sampler loses its masks
        ({"repetition_penalty": 1e39}, "repetition_penalty"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": "x"}, "bad_words"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
    ],
)
def test_sampling_rejects(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_normalises_sequences() -> None:
    p = SamplingParams(stop="END", stop_token_ids=[3, 4], logit_bias={"7": 2})  # type: ignore[arg-type,dict-item]
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4) and p.logit_bias == {7: 2.0}


def test_validate_for_vocab_names_field() -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[100]).validate_for_vocab(100)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[1, 200]).validate_for_vocab(100)
    SamplingParams(logit_bias={99: 1.0}).validate_for_vocab(100)


def test_status_order_and_finished() -> None:
    order = [S.WAITING, S.RUNNING, S.PREEMPTED, S.FINISHED_STOPPED, S.FINISHED_LENGTH_CAPPED,
             S.FINISHED_ABORTED, S.FINISHED_IGNORED]
    assert sorted(order) == order
    assert [S.is_finished(s) for s in order] == [False] * 3 + [True] * 4


def test_finish_reason_mapping() -> None:
    assert S.get_finished_reason(S.FINISHED_STOPPED) is FinishReason.STOP
    assert S.get_finished_reason(S.FINISHED_LENGTH_CAPPED) is FinishReason.LENGTH
    assert S.get_finished_reason(S.FINISHED_ABORTED) is FinishReason.ABORT
    assert S.get_finished_reason(S.FINISHED_IGNORED) is FinishReason.LENGTH
    assert S.get_finished_reason(S.RUNNING) is None
    assert str(FinishReason.LENGTH) == "length"


def test_request_token_accounting() -> None:
    req = EngineRequest("r1", [5, 6, 7], SamplingParams(max_tokens=4), eos_token_id=2)
    req.append_output_token_ids([9, 10])
    req.spec_token_ids = [11]
    assert (req.num_prompt_tokens, req.num_output_tokens, req.num_tokens) == (3, 2, 5)
    assert req.num_tokens_with_spec == 6 and req.all_token_ids == [5, 6, 7, 9, 10]
    req.record_event(EngineCoreEventType.QUEUED, timestamp=1.5)
    events = req.take_events()
    assert events is not None and events[0].type is EngineCoreEventType.QUEUED
    assert events[0].timestamp == 1.5 and req.take_events() is None


@pytest.mark.parametrize(("rid", "prompt"), [("", [1]), ("r", []), ("r", [-1])])
def test_request_rejects_bad_input(rid: str, prompt: list[int]) -> None:
    with pytest.raises(ValueError):
        EngineRequest(rid, prompt, SamplingParams(), eos_token_id=None)


def test_token_logprobs_and_empty_output() -> None:
    with pytest.raises(ValueError, match="equal length"):
        TokenLogprobs(token_ids=(1, 2), logprobs=(-0.1,), rank=1)
    out = ModelRunnerOutput.empty()
    assert out.req_ids == [] and out.sampled_token_ids == [] and out.prompt_logprobs == {}
