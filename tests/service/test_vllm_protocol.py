"""vLLM's engine protocol (smg-grpc-proto's stubs) on the shared server: the
same tokens as esurge.v1, its conventions for unset fields, refusals that
name the protocol's fields, and the management RPCs a gateway calls."""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from esurge import SamplingParams
from service.client import EngineClient
from service.errors import field_violations, status_from_rpc_error
from tests.service.conftest import LiveServer

pytestmark = [pytest.mark.timeout(300)]

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture
def stub(live_server: LiveServer) -> Iterator[Any]:
    with grpc.insecure_channel(live_server.target) as channel:
        yield pb_grpc.VllmEngineStub(channel)
    live_server.wait_idle()


def _request(rid: str, stream: bool = False, **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=PROMPT),
                              sampling_params=pb.SamplingParams(**sampling), stream=stream)


def _refusal(call: Any) -> tuple[grpc.StatusCode, list[str]]:
    with pytest.raises(grpc.RpcError) as info:
        list(call())
    status = status_from_rpc_error(info.value)
    fields = [v.field for v in field_violations(status)] if status is not None else []
    return info.value.code(), fields


def test_greedy_tokens_equal_esurge_v1(stub: Any, client: EngineClient) -> None:
    ours = client.generate_unary(PROMPT, SamplingParams(temperature=0.0, max_tokens=12,
                                                        ignore_eos=True))
    expected = list(ours.completions[0].token_ids)
    [reply] = list(stub.Generate(_request("v-unary", temperature=0.0, max_tokens=12,
                                          ignore_eos=True), timeout=60))
    done = reply.complete
    assert (list(done.output_ids), done.finish_reason) == (expected, "length")
    assert (done.prompt_tokens, done.completion_tokens) == (len(PROMPT), 12)
    replies = list(stub.Generate(_request("v-stream", stream=True, temperature=0.0,
                                          max_tokens=12, ignore_eos=True), timeout=60))
    chunks = [r.chunk for r in replies if r.WhichOneof("response") == "chunk"]
    assert [t for c in chunks for t in c.token_ids] == expected
    assert replies[-1].WhichOneof("response") == "complete"
    assert replies[-1].complete.finish_reason == "length"


def test_n_samples_logprobs_and_unset_defaults(stub: Any) -> None:
    # top_p 0, repetition_penalty 0 and top_k 0 are the protocol's "unset".
    replies = list(stub.Generate(_request("v-n", n=2, seed=3, max_tokens=5, logprobs=2,
                                          prompt_logprobs=1, ignore_eos=True), timeout=60))
    completes = sorted((r.complete for r in replies), key=lambda c: c.index)
    assert [c.index for c in completes] == [0, 1]
    for done in completes:
        assert len(done.output_ids) == 5
        assert list(done.output_logprobs.token_ids) == list(done.output_ids)
        assert all(len(t.values) == 2 for t in done.output_logprobs.top_logprobs)
        assert list(done.input_logprobs.token_ids) == PROMPT
        values = done.input_logprobs.token_logprobs
        assert not values[0].HasField("value") and all(v.HasField("value") for v in values[1:])


@pytest.mark.parametrize(("sampling", "field"), [
    ({"logprobs": -1}, "sampling_params.logprobs"),
    # esurge.v1's limit: n = 2**32 - 1 was accepted and its children filled the
    # memory until the process was killed (found by tests/service/test_vllm_fuzz.py).
    ({"n": 2 ** 32 - 1}, "sampling_params.n"),
    ({"n": 17}, "sampling_params.n"),
    ({"top_p": 1.5}, "sampling_params.top_p"),
    ({"structural_tag": "{}"}, "sampling_params.structural_tag"),
    ({"json_schema": '{"type": "array", "uniqueItems": true}'}, "sampling_params.json_schema"),
    ({"regex": "a", "ignore_eos": True}, "sampling_params.ignore_eos"),
])
def test_refusals_name_the_protocols_field(stub: Any, sampling: dict[str, Any],
                                           field: str) -> None:
    code, fields = _refusal(lambda: stub.Generate(_request("v-bad", max_tokens=2, **sampling),
                                                  timeout=30))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, [field])


def test_what_the_engine_does_not_do_is_refused(stub: Any) -> None:
    msg = _request("v-mm", max_tokens=2)
    msg.kv_transfer_params_json = "{}"
    assert _refusal(lambda: stub.Generate(msg, timeout=30)) == (
        grpc.StatusCode.INVALID_ARGUMENT, ["kv_transfer_params_json"])
    with pytest.raises(grpc.RpcError) as info:
        stub.Embed(pb.EmbedRequest(request_id="e"), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_abort_ends_the_stream_with_abort(stub: Any) -> None:
    stream = stub.Generate(_request("v-abort", stream=True, max_tokens=400, ignore_eos=True),
                           timeout=60)
    first = next(stream)
    assert first.WhichOneof("response") == "chunk"
    stub.Abort(pb.AbortRequest(request_ids=["v-abort"]), timeout=30)
    last = list(stream)[-1]
    assert last.complete.finish_reason == "abort"


def test_management_rpcs(stub: Any, live_server: LiveServer) -> None:
    health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=30)
    assert health.healthy
    model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    engine = live_server.engine
    assert model.max_context_length == engine.config.scheduler_config.max_model_len
    assert model.vocab_size == engine.model.vocab_size and model.is_generation
    assert list(model.eos_token_ids) == [2]
    server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    assert server.max_num_seqs == engine.config.scheduler_config.max_num_seqs
    loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=30)
    assert loads.dp_rank_count == 1 and loads.loads[0].num_running_reqs == 0
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(names)


def test_kv_events_report_stored_pages(live_server: LiveServer) -> None:
    page = live_server.engine.config.cache_config.page_size
    # Three full pages and a partial one, of ids no other test sends (never cached yet).
    prompt = [int(t) for t in np.random.default_rng(1234).integers(300, 500, 3 * page + 2)]
    wanted = [prompt[i * page:(i + 1) * page] for i in range(3)]
    with grpc.insecure_channel(live_server.target) as channel:
        stub = pb_grpc.VllmEngineStub(channel)
        events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
            load_records_before_first_batch=True), timeout=120)
        assert next(events).load.load_only  # subscribed: the feed records from now on
        list(stub.Generate(pb.GenerateRequest(
            request_id="kv-1", tokenized=pb.TokenizedInput(input_ids=prompt),
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=1)), timeout=60))
        cleared, mine = False, []
        for batch in events:  # the stream is bounded by its 120 s deadline
            for event in batch.events:
                cleared = cleared or event.WhichOneof("data") == "cleared"
                if event.WhichOneof("data") == "stored" and any(
                        list(b.token_ids) in wanted for b in event.stored.blocks):
                    mine.append(event.stored)
            if sum(len(s.blocks) for s in mine) >= 3:
                break
        events.cancel()
    assert cleared  # the stream opens with a clear: the subscriber's index starts empty
    blocks = [b for s in mine for b in s.blocks]
    assert [list(b.token_ids) for b in blocks] == wanted
    assert all(b.block_size == page for b in blocks)
    assert not mine[0].HasField("parent_block_hash")  # the prompt's first page
    # Each later page chains to the one before it.
    parents = [s.parent_block_hash for s in mine[1:]]
    assert parents == [b.block_hash for b in blocks[:len(parents)]] or len(mine) == 1
    live_server.wait_idle()
