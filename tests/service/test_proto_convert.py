"""Proto <-> engine conversions: presence-based defaults, field paths, round trips."""

from __future__ import annotations

from dataclasses import MISSING, fields

import numpy as np
import pytest

from esurge.config import CacheConfig, Config, SchedulerConfig, SpeculativeConfig
from esurge.engine_types import (
    EngineCoreEvent,
    EngineCoreEventType,
    FinishReason,
)
from esurge.errors import InvalidRequestError, RequestField
from esurge.outputs import TokenLogprobs
from esurge.sampling_params import SamplingParams
from esurge.structured_output.params import StructuredOutputsParams
from generated.esurge.v1 import config_pb2, engine_pb2, sampling_pb2
from service import convert
from service.errors import FieldViolation, InvalidFieldError

FULL_PARAMS = SamplingParams(
    n=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
    frequency_penalty=-0.25, repetition_penalty=1.1, seed=-7, max_tokens=64, min_tokens=2,
    stop=("\n\n", "END"), stop_token_ids=(2, 13), ignore_eos=True,
    include_stop_str_in_output=True, logit_bias={7: -5.5, 3: 100.0},
    allowed_token_ids=(3, 7, 9), bad_words=("darn",), logprobs=5, prompt_logprobs=0,
    skip_special_tokens=False,
)


def _violations(msg: sampling_pb2.SamplingParams, **kw: str) -> tuple[FieldViolation, ...]:
    with pytest.raises(InvalidFieldError) as info:
        convert.sampling_params_from_proto(msg, **kw)
    return info.value.violations


def test_every_engine_sampling_field_has_a_proto_field() -> None:
    proto_names = {f.name for f in sampling_pb2.SamplingParams.DESCRIPTOR.fields}
    assert proto_names == convert.SAMPLING_FIELDS | {"max_tokens_unbounded"}
    assert "bad_words_token_ids" not in proto_names


def test_presence_exactly_where_the_engine_default_is_not_zero() -> None:
    by_name = {f.name: f for f in sampling_pb2.SamplingParams.DESCRIPTOR.fields}
    checked = []
    for f in fields(SamplingParams):
        proto = by_name.get(f.name)
        if proto is None or proto.is_repeated:  # repeated/map: empty is the engine's None/()
            continue
        assert f.default is not MISSING
        needs_presence = f.default is None or f.default not in (0, 0.0, False, "")
        assert proto.has_presence == needs_presence, f.name
        checked.append(f.name)
    assert len(checked) == 17


def test_full_params_round_trip_over_the_wire() -> None:
    wire = convert.sampling_params_to_proto(FULL_PARAMS).SerializeToString()
    back = convert.sampling_params_from_proto(sampling_pb2.SamplingParams.FromString(wire))
    assert back == FULL_PARAMS
    assert back.logit_bias == {3: 100.0, 7: -5.5}


def test_unset_fields_take_engine_defaults() -> None:
    assert convert.sampling_params_from_proto(sampling_pb2.SamplingParams()) == SamplingParams()
    params = convert.sampling_params_from_proto(sampling_pb2.SamplingParams())
    assert (params.n, params.temperature, params.top_p, params.max_tokens) == (1, 1.0, 1.0, 16)
    assert params.top_k is None and params.seed is None and params.logprobs is None
    assert params.allowed_token_ids is None and params.logit_bias is None
    assert params.skip_special_tokens is True and params.repetition_penalty == 1.0


def test_explicit_zero_values_survive_the_wire() -> None:
    msg = sampling_pb2.SamplingParams(temperature=0.0, skip_special_tokens=False, logprobs=0,
                                      seed=0)
    params = convert.sampling_params_from_proto(
        sampling_pb2.SamplingParams.FromString(msg.SerializeToString()))
    assert params.greedy and params.temperature == 0.0
    assert params.skip_special_tokens is False
    assert params.logprobs == 0 and params.seed == 0


def test_max_tokens_unbounded_gives_none_and_excludes_max_tokens() -> None:
    unbounded = sampling_pb2.SamplingParams(max_tokens_unbounded=True)
    assert convert.sampling_params_from_proto(unbounded).max_tokens is None
    assert convert.sampling_params_to_proto(SamplingParams(max_tokens=None)).max_tokens_unbounded
    both = sampling_pb2.SamplingParams(max_tokens=8, max_tokens_unbounded=True)
    [violation] = _violations(both)
    assert violation.field == "sampling_params.max_tokens_unbounded"


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (sampling_pb2.SamplingParams(top_p=1.5), "sampling_params.top_p"),
        (sampling_pb2.SamplingParams(n=0), "sampling_params.n"),
        (sampling_pb2.SamplingParams(top_k=0), "sampling_params.top_k"),
        (sampling_pb2.SamplingParams(temperature=float("nan")), "sampling_params.temperature"),
        (sampling_pb2.SamplingParams(max_tokens=4, min_tokens=5), "sampling_params.min_tokens"),
        (sampling_pb2.SamplingParams(logprobs=21), "sampling_params.logprobs"),
        (sampling_pb2.SamplingParams(logit_bias={5: 300.0}), "sampling_params.logit_bias[5]"),
        (sampling_pb2.SamplingParams(stop=["ok", ""]), "sampling_params.stop"),
        (sampling_pb2.SamplingParams(presence_penalty=2.5), "sampling_params.presence_penalty"),
    ],
)
def test_bad_sampling_value_names_the_proto_field(
    msg: sampling_pb2.SamplingParams, field: str
) -> None:
    [violation] = _violations(msg)
    assert violation.field == field
    assert violation.description.startswith(field.removeprefix("sampling_params.") + " must")


def test_top_p_error_keeps_the_engine_message_under_a_custom_prefix() -> None:
    [violation] = _violations(sampling_pb2.SamplingParams(top_p=1.5),
                              field_prefix="request.sampling_params")
    assert violation == FieldViolation("request.sampling_params.top_p",
                                       "top_p must be in (0, 1], got 1.5")


def _request(**kw: object) -> engine_pb2.EngineRequest:
    return engine_pb2.EngineRequest(**kw)  # type: ignore[arg-type]


def test_token_prompt_request_with_defaults() -> None:
    req = convert.engine_request_from_proto(
        _request(prompt_token_ids=engine_pb2.TokenIds(token_ids=[5, 6, 7])))
    assert req == convert.GenerationRequest(
        request_id=None, prompt_token_ids=(5, 6, 7), prompt_text=None,
        sampling_params=SamplingParams(), priority=0, cache_salt=None, return_text=True,
        return_prompt_token_ids=False, return_events=False)


def test_request_round_trip_keeps_every_field() -> None:
    original = convert.GenerationRequest(
        request_id="r-1", prompt_token_ids=None, prompt_text="Hello", sampling_params=FULL_PARAMS,
        priority=-3, cache_salt="tenant-a", return_text=False, return_prompt_token_ids=True,
        return_events=True)
    wire = convert.engine_request_to_proto(original).SerializeToString()
    back = convert.engine_request_from_proto(engine_pb2.EngineRequest.FromString(wire))
    assert back == original


def test_request_reports_every_violation_under_the_prefix() -> None:
    msg = _request(sampling_params=sampling_pb2.SamplingParams(top_p=0.0))
    with pytest.raises(InvalidFieldError) as info:
        convert.engine_request_from_proto(msg, field_prefix="request")
    assert [v.field for v in info.value.violations] == [
        "request.prompt", "request.sampling_params.top_p"]
    assert ("request.prompt: one of prompt_token_ids, prompt_text or chat must be set"
            in str(info.value))


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (_request(prompt_token_ids=engine_pb2.TokenIds()), "prompt_token_ids"),
        (_request(prompt_text=""), "prompt_text"),
    ],
)
def test_empty_prompt_is_refused(msg: engine_pb2.EngineRequest, field: str) -> None:
    with pytest.raises(InvalidFieldError) as info:
        convert.engine_request_from_proto(msg)
    assert [v.field for v in info.value.violations] == [field]


def test_finish_reason_mapping_is_exact() -> None:
    table = {None: engine_pb2.FINISH_REASON_UNSPECIFIED, FinishReason.STOP: 1,
             FinishReason.LENGTH: 2, FinishReason.ABORT: 3}
    for reason, value in table.items():
        assert convert.finish_reason_to_proto(reason) == value


def test_stop_reason_fills_the_oneof() -> None:
    msg = engine_pb2.EngineCoreOutput()
    convert.set_stop_reason(msg, None)
    assert msg.WhichOneof("stop_reason") is None
    convert.set_stop_reason(msg, 2)
    assert (msg.WhichOneof("stop_reason"), msg.stop_token_id) == ("stop_token_id", 2)
    convert.set_stop_reason(msg, "END")
    assert (msg.WhichOneof("stop_reason"), msg.stop_string) == ("stop_string", "END")


def test_events_and_prompt_logprobs_to_proto() -> None:
    event = convert.event_to_proto(EngineCoreEvent(EngineCoreEventType.PREEMPTED, 2.25))
    assert (event.type, event.timestamp) == (engine_pb2.ENGINE_CORE_EVENT_TYPE_PREEMPTED, 2.25)
    entries = convert.prompt_logprobs_to_proto([None, TokenLogprobs((5, 6), (-0.5, -1.25), 2)])
    assert not entries[0].HasField("logprobs")
    assert list(entries[1].logprobs.token_ids) == [5, 6] and entries[1].logprobs.rank == 2


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_bad_stop_reason_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="stop_reason"):
        convert.set_stop_reason(engine_pb2.EngineCoreOutput(), bad)  # type: ignore[arg-type]


def test_logprobs_travel_as_float32() -> None:
    msg = convert.token_logprobs_to_proto(TokenLogprobs((1,), (-0.1,), 1))
    back = engine_pb2.TokenLogprobs.FromString(msg.SerializeToString())
    assert tuple(back.logprobs) == (float(np.float32(-0.1)),)
    assert tuple(back.logprobs) != (-0.1,)


def test_full_config_round_trip() -> None:
    config = Config(
        scheduler_config=SchedulerConfig(
            max_num_seqs=32, max_num_batched_tokens=512, max_model_len=4096, policy="priority",
            long_prefill_token_threshold=128, chunked_prefill_enabled=True,
            token_safety_margin=8, max_num_seq_buckets=(8, 16, 32), async_scheduling=True),
        cache_config=CacheConfig(num_pages=1000, page_size=16, enable_prefix_caching=True),
        speculative_config=SpeculativeConfig(num_speculative_tokens=4,
                                             speculative_model="/models/eagle"),
    )
    msg = convert.config_to_proto(config)
    assert msg.scheduler_config.policy == config_pb2.SCHEDULING_POLICY_PRIORITY
    wire = config_pb2.EngineConfig.FromString(msg.SerializeToString())
    assert convert.config_from_proto(wire) == config


def test_config_none_fields_are_absent() -> None:
    config = Config(
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256,
                                         max_model_len=256),
        cache_config=CacheConfig(num_pages=None, page_size=8, enable_prefix_caching=False),
    )
    msg = convert.config_to_proto(config)
    assert not msg.cache_config.HasField("num_pages")
    assert not msg.scheduler_config.HasField("token_safety_margin")
    assert not msg.HasField("speculative_config")
    assert list(msg.scheduler_config.max_num_seq_buckets) == []
    assert msg.scheduler_config.policy == config_pb2.SCHEDULING_POLICY_FCFS
    assert convert.config_from_proto(msg) == config
    msg.scheduler_config.policy = config_pb2.SCHEDULING_POLICY_UNSPECIFIED
    with pytest.raises(ValueError, match="policy"):
        convert.config_from_proto(msg)


@pytest.mark.parametrize("so", [
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}},
                            disable_any_whitespace=True, disable_additional_properties=True),
    StructuredOutputsParams(json_object=True, whitespace_pattern="[ ]?"),
    StructuredOutputsParams(regex="[0-9]{3}"),
    StructuredOutputsParams(choice=("yes", "no")),
    StructuredOutputsParams(grammar='start: "x"'),
], ids=["json", "json_object", "regex", "choice", "grammar"])
def test_structured_outputs_round_trip_over_the_wire(so: StructuredOutputsParams) -> None:
    params = SamplingParams(max_tokens=8, structured_outputs=so)
    wire = convert.sampling_params_to_proto(params).SerializeToString()
    back = convert.sampling_params_from_proto(sampling_pb2.SamplingParams.FromString(wire))
    assert back.structured_outputs == so or (
        back.structured_outputs is not None and so.kind == "json"
        and back.structured_outputs.schema() == so.schema())


def test_token_id_bad_words_are_refused_not_dropped() -> None:
    """esurge.v1 carries bad words as text: the client used to drop token-id ones
    silently, and the banned token came back (found by test_mix_grpc)."""
    params = SamplingParams(max_tokens=8).with_bad_words_token_ids(((153,),))
    with pytest.raises(InvalidRequestError) as refused:
        convert.sampling_params_to_proto(params)
    assert refused.value.field == RequestField.sampling("bad_words_token_ids")
    text = SamplingParams(max_tokens=8, bad_words=("x",))
    assert list(convert.sampling_params_to_proto(text).bad_words) == ["x"]
