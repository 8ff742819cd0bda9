"""vLLM's engine protocol (the one smg speaks) under the same property as
esurge.v1 (tests/service/test_request_fuzz.py): any GenerateRequest gets its
samples, within max_tokens, or INVALID_ARGUMENT naming a field it set, and the
server is left idle with the greedy tokens it gave before."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from service.errors import field_violations, status_from_rpc_error
from tests.service.conftest import LiveServer
from tests.service.test_request_fuzz import (
    EXAMPLES,
    INF,
    NAN,
    U32,
    VOCAB,
    empty_repeated,
    mostly,
    regexes,
    schemas,
    set_paths,
    texts,
    token_ids,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

I32 = 2 ** 31 - 1
counts = mostly([0, 1, 5, 20], [-1, 21, I32, -I32 - 1])
# The protocol's proto3 zeros mean "unset" for top_p, top_k, n and repetition_penalty.
SCALARS: dict[str, st.SearchStrategy[Any]] = {
    "temperature": mostly([0.0, 0.5, 1.0], [-1.0, NAN, INF, 1e31]),
    "top_p": mostly([0.0, 0.5, 1.0], [1.5, -0.5, NAN]),
    "top_k": mostly([0, 1, 5, VOCAB], [VOCAB + 1, U32]),
    "min_p": mostly([0.0, 0.1], [1.5, -0.1, NAN]),
    "frequency_penalty": mostly([0.0, 0.5], [2.5, NAN, -INF]),
    "presence_penalty": mostly([0.0, -1.0], [-2.5, INF]),
    "repetition_penalty": mostly([0.0, 1.0, 1.2], [-1.0, NAN, INF]),
    "max_tokens": mostly([1, 4], [0]),
    "min_tokens": mostly([0, 1, 3], [5, U32]),
    "n": mostly([0, 1, 2], [64, U32]),
    "logprobs": counts,
    "prompt_logprobs": counts,
    "seed": mostly([0, 1, -1], [I32, -I32 - 1]),
    "truncate_prompt_tokens": mostly([2, 100], [0, -1, -I32 - 1]),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "grammar_from_first_token": st.booleans(),
}
CONSTRAINTS: dict[str, st.SearchStrategy[Any]] = {
    "json_schema": schemas, "regex": regexes, "json_object": st.booleans(),
    "grammar": mostly(['root ::= "a" | "b"'], ["root ::=", "garbage ::= ("]),
    "structural_tag": mostly(["{}"], ["", "x"]),
}


@st.composite
def requests(draw: st.DrawFn) -> pb.GenerateRequest:
    """A vLLM GenerateRequest with a random subset of sampling fields set."""
    p = pb.SamplingParams()
    for name in draw(st.sets(st.sampled_from(sorted(SCALARS)), max_size=6)):
        setattr(p, name, draw(SCALARS[name]))
    if not p.HasField("max_tokens"):
        p.max_tokens = 4
    p.stop.extend(draw(st.lists(texts, max_size=2)))
    p.stop_token_ids.extend(draw(st.lists(token_ids, max_size=2)))
    biases = mostly([0.0, 2.5, -100.0], [NAN, INF, 1e30])
    for token, bias in draw(st.dictionaries(mostly([0, 5, VOCAB - 1], [-1, VOCAB, I32]),
                                            biases, max_size=2)).items():
        p.logit_bias[token] = bias
    constraint = draw(mostly(["none"] * 4, [*sorted(CONSTRAINTS), "choice"]))
    if constraint == "choice":
        p.choice.choices.extend(draw(st.lists(texts, max_size=3)))
    elif constraint != "none":
        setattr(p, constraint, draw(CONSTRAINTS[constraint]))
    request = pb.GenerateRequest(request_id=draw(mostly(["v-fuzz"], ["", "é\n"])),
                                 sampling_params=p, stream=draw(st.booleans()))
    prompt = draw(mostly(["ids", "ids", "text"], ["none"]))
    if prompt == "ids":
        request.tokenized.input_ids.extend(draw(st.lists(token_ids, min_size=0, max_size=6)))
    elif prompt == "text":
        request.text = draw(texts)
    return request


@pytest.fixture(scope="module")
def channel(live_server: LiveServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(live_server.target) as ch:
        yield ch


def _greedy(stub: Any) -> list[int]:
    request = pb.GenerateRequest(request_id="v-greedy",
                                 tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
                                 sampling_params=pb.SamplingParams(
                                     temperature=0.0, max_tokens=12, ignore_eos=True))
    [reply] = list(stub.Generate(request, timeout=60))
    return list(reply.complete.output_ids)


@pytest.fixture(scope="module")
def greedy_before(channel: grpc.Channel) -> list[int]:
    return _greedy(pb_grpc.VllmEngineStub(channel))


@seed(int(os.environ.get("ESURGE_FUZZ_SEED", "0")))
@settings(max_examples=EXAMPLES, deadline=None,
          derandomize="ESURGE_FUZZ_SEED" not in os.environ,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=requests())
def test_every_vllm_request_gets_its_samples_or_a_named_refusal(
        channel: grpc.Channel, greedy_before: list[int], request: Any) -> None:
    stub = pb_grpc.VllmEngineStub(channel)
    try:
        replies = list(stub.Generate(request, timeout=60))
    except grpc.RpcError as error:
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        status = status_from_rpc_error(error)
        assert status is not None, error.details()
        violations = field_violations(status)
        assert violations, status.message
        given = set_paths(request)
        for violation in violations:
            base = violation.field.split("[")[0]
            named = base in given or empty_repeated(request, base)
            # No input at all is named by the field to set.
            missing = request.WhichOneof("input") is None and base == "tokenized"
            assert named or missing, (violation, sorted(given))
            assert violation.field in status.message  # the message names the same field
        return
    completes = [r.complete for r in replies if r.WhichOneof("response") == "complete"]
    p = request.sampling_params
    assert sorted(c.index for c in completes) == list(range(p.n or 1)), completes
    assert all(len(c.output_ids) <= p.max_tokens for c in completes)


def test_the_server_is_unharmed_after_the_vllm_fuzzing(channel: grpc.Channel,
                                                       live_server: LiveServer,
                                                       greedy_before: list[int]) -> None:
    load = live_server.wait_idle()
    assert (load.num_running_requests, load.num_waiting_requests) == (0, 0)
    assert load.kv_cache_usage == 0.0
    assert _greedy(pb_grpc.VllmEngineStub(channel)) == greedy_before
