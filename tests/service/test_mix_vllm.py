"""Over vLLM's engine protocol (what smg sends), each request of a concurrent mix
gets what the library gives it alone.

The mixes of tests/engine/test_mix_fuzz.py, less what the protocol cannot say
(allow-lists, bad words, priorities; seeds within its int32), go to the shared
real server all at once, one thread per request: every other request with
`stream=True`, whose chunks are added up (some aborted by the protocol's
Abort after a few), the rest answered by completes only. Each sample must
carry the tokens, finish reason, matched stop, logprobs and prompt logprobs
(in the protocol's columnar form) that `eSurge.generate` returns for the
request alone, and counts that match them; an aborted one, a prefix of them.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import given, seed
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from esurge.engine.request_output import CompletionOutput, RequestOutput
from esurge.engine_types import FinishReason
from esurge.outputs import TokenLogprobs
from esurge.sampling_params import SamplingParams
from tests.engine.test_mix_fuzz import Mix, fuzz_settings, mixes
from tests.service.conftest import LiveServer
from tests.service.test_mix_grpc import LONG, assert_tokens_as_alone

EXAMPLES = int(os.environ.get("ESURGE_FUZZ_EXAMPLES", "30"))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _protocol_params(p: SamplingParams) -> SamplingParams:
    """The request as the protocol can carry it (no allow-list, no bad words,
    a seed in int32)."""
    return dataclasses.replace(p, allowed_token_ids=None, bad_words_token_ids=(),
                               seed=None if p.seed is None else p.seed % 2 ** 31)


def _to_vllm(prompt: list[int], p: SamplingParams, request_id: str, stream: bool
             ) -> pb.GenerateRequest:
    msg = pb.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or 0, min_p=p.min_p,
        frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens, stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids), skip_special_tokens=p.skip_special_tokens,
        ignore_eos=p.ignore_eos, n=p.n, include_stop_str_in_output=p.include_stop_str_in_output,
        logit_bias=p.logit_bias or {})
    for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
        if getattr(p, name) is not None:
            setattr(msg, name, getattr(p, name))
    so = p.structured_outputs
    if so is not None and so.regex is not None:
        msg.regex = so.regex
    elif so is not None and so.choice is not None:
        msg.choice.choices.extend(so.choice)
    return pb.GenerateRequest(request_id=request_id, stream=stream, sampling_params=msg,
                              tokenized=pb.TokenizedInput(input_ids=prompt))


def _output_logprobs(msg: pb.GenerateStreamChunk | pb.GenerateComplete
                     ) -> list[TokenLogprobs]:
    lp = msg.output_logprobs
    return [TokenLogprobs((token, *top.token_ids), (value, *top.values), None)
            for token, value, top in zip(lp.token_ids, lp.token_logprobs, lp.top_logprobs,
                                         strict=True)]


def _input_logprobs(msg: pb.GenerateStreamChunk | pb.GenerateComplete, prompt: list[int]
                    ) -> list[TokenLogprobs | None] | None:
    if not msg.HasField("input_logprobs"):
        return None
    lp = msg.input_logprobs
    assert list(lp.token_ids) == prompt
    return [TokenLogprobs((token, *top.token_ids), (value.value, *top.values), None)
            if value.HasField("value") else None
            for token, value, top in zip(lp.token_ids, lp.token_logprobs, lp.top_logprobs,
                                         strict=True)]


def _stop(done: pb.GenerateComplete) -> int | str | None:
    which = done.WhichOneof("matched_stop")
    return None if which is None else getattr(done, which)


def _answer(prompt: list[int], replies: list[pb.GenerateResponse], stream: bool
            ) -> RequestOutput:
    """The output the replies say: chunks added up when streamed, else the completes."""
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[TokenLogprobs]] = {}
    completes: dict[int, pb.GenerateComplete] = {}
    prompt_logprobs: dict[int, list[TokenLogprobs | None] | None] = {}
    for reply in replies:
        kind = reply.WhichOneof("response")
        msg = reply.chunk if kind == "chunk" else reply.complete
        assert (msg.prompt_tokens, msg.index not in completes) == (len(prompt), True), reply
        if kind == "chunk":
            assert stream and msg.completion_tokens == len(msg.token_ids), reply
            if msg.index not in tokens:  # the first chunk of a sample carries them
                prompt_logprobs[msg.index] = _input_logprobs(msg, prompt)
            else:
                assert not msg.HasField("input_logprobs"), reply
            tokens.setdefault(msg.index, []).extend(msg.token_ids)
            logprobs.setdefault(msg.index, []).extend(_output_logprobs(msg))
            continue
        completes[msg.index] = msg
        prompt_logprobs.setdefault(msg.index, _input_logprobs(msg, prompt))
        assert _input_logprobs(msg, prompt) == prompt_logprobs[msg.index], reply
        if not stream:
            tokens[msg.index], logprobs[msg.index] = list(msg.output_ids), _output_logprobs(msg)
        assert msg.completion_tokens == len(msg.output_ids), reply
    samples = [CompletionOutput(i, "", tokens.get(i, []), FinishReason[done.finish_reason.upper()],
                                _stop(done), logprobs.get(i) or None)
               for i, done in sorted(completes.items())]
    shared = {str(v) for v in prompt_logprobs.values()}
    assert len(shared) == 1, f"samples differ in their prompt logprobs: {prompt_logprobs}"
    return RequestOutput("", None, prompt, samples, True,
                         prompt_logprobs=next(iter(prompt_logprobs.values())))


def _send(target: str, prompt: list[int], params: SamplingParams, i: int,
          abort_after: int | None) -> RequestOutput:
    """One request; a streamed one with an abort point is aborted by the
    protocol's Abort (as smg does when its client hangs up) after that many
    chunks, and its call still ends with a complete per sample."""
    stream = i % 2 == 1
    replies = []
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.VllmEngineStub(channel)
        for reply in stub.Generate(_to_vllm(prompt, params, f"vllm-mix-{i}", stream),
                                   timeout=60):
            replies.append(reply)
            if stream and len(replies) == abort_after:
                stub.Abort(pb.AbortRequest(request_ids=[f"vllm-mix-{i}"]), timeout=60)
    return _answer(prompt, replies, stream)


@seed(int(os.environ.get("ESURGE_FUZZ_SEED", "0")))
@fuzz_settings(EXAMPLES)
@given(mix=mixes(max_len=LONG))
def test_a_mix_over_the_vllm_protocol_gives_each_request_what_it_gets_alone(
        live_server: LiveServer, mix: Mix) -> None:
    params = [_protocol_params(p) for p in mix.params]
    engine = live_server.engine
    alone = [engine.generate([p], ps)[0] for p, ps in zip(mix.prompts, params, strict=True)]
    n = len(mix.prompts)
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda i: _send(live_server.target, mix.prompts[i],
                                                params[i], i, mix.aborts[i]), range(n)))
    assert_tokens_as_alone(alone, answers, mix)
    load = live_server.wait_idle()
    assert (load.num_running_requests, load.num_waiting_requests) == (0, 0), load
    assert load.kv_cache_usage == 0.0, load

