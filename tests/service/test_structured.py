"""Structured outputs over gRPC: a constraint is honoured, a bad one is
INVALID_ARGUMENT naming its field, and it changes no other request's tokens."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from esurge import SamplingParams, StructuredOutputsParams
from generated.esurge.v1 import engine_pb2, sampling_pb2
from service.client import EngineClient, build_request
from tests.service.test_server_errors import _raw_unary, _string_field, _varint, refusal
from tests.structured.cases import JSON_SCHEMAS, validates_json

pytestmark = [pytest.mark.timeout(300)]

SCHEMA = JSON_SCHEMAS["person"]
PROMPT = [5, 6, 7, 8, 9]
FIELD = "request.sampling_params.structured_outputs"


def _constrained(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured_outputs=(
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)))


def test_model_info_lists_the_kinds(client: EngineClient) -> None:
    options = client.model_info().supported_options
    assert list(options.structured_output_kinds) == [
        "json", "json_object", "regex", "choice", "grammar"]
    assert options.structured_output_backend.startswith("llguidance ")
    assert "structured_outputs" in options.sampling_params


def test_json_schema_output_validates(client: EngineClient) -> None:
    stops = 0
    for seed in range(4):
        done = client.generate_unary(PROMPT, _constrained(seed)).completions[0]
        if done.finish_reason == engine_pb2.FINISH_REASON_STOP:
            stops += 1
            assert validates_json(SCHEMA, done.text), done.text
    assert stops >= 2


def test_choice_and_regex_travel_through_the_proto(client: EngineClient) -> None:
    params = sampling_pb2.SamplingParams(temperature=0.0, max_tokens=30)
    params.structured_outputs.choice.choices.extend(["alpha", "beta", "gamma"])
    done = client.generate_unary(PROMPT, params).completions[0]
    assert done.text in ("alpha", "beta", "gamma")
    assert done.finish_reason == engine_pb2.FINISH_REASON_STOP
    params = sampling_pb2.SamplingParams(temperature=0.0, max_tokens=30)
    params.structured_outputs.regex = "[0-9]{2}-[0-9]{2}"
    done = client.generate_unary(PROMPT, params).completions[0]
    assert len(done.text) == 5 and done.text[2] == "-", done.text


def _refused(client: EngineClient, params: sampling_pb2.SamplingParams
             ) -> tuple[grpc.StatusCode, list[str], str]:
    code, fields, status = refusal(lambda: client.generate_unary(PROMPT, params))
    return code, fields, status.message


def test_a_bad_schema_names_the_json_field(client: EngineClient) -> None:
    params = sampling_pb2.SamplingParams(max_tokens=8)
    # llguidance does not implement uniqueItems: a compile error, reported as such.
    params.structured_outputs.json = json.dumps({"type": "array", "uniqueItems": True})
    code, fields, _ = _refused(client, params)
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, [f"{FIELD}.json"])
    params.structured_outputs.json = "{not json"
    assert _refused(client, params)[:2] == (grpc.StatusCode.INVALID_ARGUMENT, [f"{FIELD}.json"])
    params = sampling_pb2.SamplingParams(max_tokens=8)
    params.structured_outputs.regex = "[a-"
    code, fields, message = _refused(client, params)
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, [f"{FIELD}.regex"])
    assert "unclosed character class" in message  # the compiler's own words


def test_knobs_and_combinations_are_refused(client: EngineClient) -> None:
    params = sampling_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
    params.structured_outputs.regex = "a"
    assert _refused(client, params)[:2] == (
        grpc.StatusCode.INVALID_ARGUMENT, ["request.sampling_params.ignore_eos"])
    params = sampling_pb2.SamplingParams(max_tokens=8)
    params.structured_outputs.regex = "a"
    params.structured_outputs.disable_any_whitespace = True
    assert _refused(client, params)[:2] == (
        grpc.StatusCode.INVALID_ARGUMENT, [f"{FIELD}.disable_any_whitespace"])
    params = sampling_pb2.SamplingParams(max_tokens=8)
    params.structured_outputs.SetInParent()  # present, but no constraint in it
    assert _refused(client, params)[:2] == (grpc.StatusCode.INVALID_ARGUMENT, [f"{FIELD}.json"])


def test_two_constraints_at_once_are_refused(client: EngineClient) -> None:
    # StructuredOutputs: regex (3) and then grammar (5), both members of the
    # oneof: the parser would keep the grammar alone.
    both = _string_field(3, b"[a-z]{2}") + _string_field(5, b'start: "x"')
    sampling = _string_field(23, both)  # SamplingParams.structured_outputs
    request = build_request(PROMPT).SerializeToString() + _string_field(4, sampling)
    code, fields, _ = refusal(lambda: _raw_unary(client, "GenerateUnary")(
        _string_field(1, request), timeout=10))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, [f"{FIELD}.grammar"])


def test_an_unknown_option_is_refused(client: EngineClient) -> None:
    extra = _string_field(3, b"[a-z]{2}") + _varint(99 << 3) + b"\x01"
    request = build_request(PROMPT).SerializeToString() + _string_field(
        4, _string_field(23, extra))
    code, fields, _ = refusal(lambda: _raw_unary(client, "GenerateUnary")(
        _string_field(1, request), timeout=10))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, [FIELD])


def test_constrained_and_free_requests_share_a_batch(client: EngineClient) -> None:
    free = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=40) for i in range(3)]
    alone = [list(client.generate_unary(PROMPT, p).completions[0].token_ids) for p in free]
    constrained_alone = list(client.generate_unary(PROMPT, _constrained(7))
                             .completions[0].token_ids)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.generate_unary, PROMPT, p) for p in free]
        futures.append(pool.submit(client.generate_unary, PROMPT, _constrained(7)))
        together = [list(f.result().completions[0].token_ids) for f in futures]
    assert together == [*alone, constrained_alone]
