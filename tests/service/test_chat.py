"""Chat over gRPC: the server renders the messages with the model's chat template.

The shared tiny model carries a ChatML-like template (tests/conftest.py); a
reply must be exactly what `eSurge.chat` gives in-process, from the Python
client and from Node's @grpc/grpc-js, and must end at the template's
end-of-turn token without the client naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest

from esurge.engine.chat import ChatPrompt
from esurge.engine.inputs import InputProcessor
from esurge.errors import InvalidRequestError
from esurge.sampling_params import SamplingParams
from service.admission import engine_error_violation
from service.client import EngineClient
from service.convert import engine_request_from_proto
from service.errors import field_violations, status_from_rpc_error
from tests.service.test_server_polyglot import REPO, _tool, node_modules  # noqa: F401

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def main():"}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24)


def _in_process(live_server: Any) -> Any:
    return live_server.engine.chat(MESSAGES, PARAMS)


def test_python_client_chat_equals_the_library(live_server: Any, client: EngineClient) -> None:
    expected = _in_process(live_server)
    messages = list(client.generate(ChatPrompt.of(MESSAGES), PARAMS))
    tokens = [t for m in messages for t in m.token_ids]
    assert tokens == expected.outputs[0].token_ids
    assert messages[0].prompt_info.num_prompt_tokens == len(expected.prompt_token_ids)
    rendered = live_server.engine.chat_template.render(ChatPrompt.of(MESSAGES))
    assert rendered.startswith("<s>system\nYou write Python.</s>\n<s>user\n")
    assert rendered.endswith("<s>assistant\n")


def test_a_reply_ends_at_the_end_of_turn(live_server: Any, client: EngineClient) -> None:
    # An unbounded reply of a random model: either it emits </s> (the template's
    # end of turn) and stops there, or it runs to max_tokens.
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=200)
    streamed = [t for m in client.generate(ChatPrompt.of(MESSAGES), params) for t in m.token_ids]
    reply = live_server.engine.chat(MESSAGES, params).outputs[0]
    assert streamed == reply.token_ids
    assert reply.finish_reason in ("stop", "length")
    if reply.finish_reason == "stop":
        assert reply.token_ids[-1] == 2 and 2 not in reply.token_ids[:-1]
    else:
        assert 2 not in reply.token_ids


def test_node_client_chat_equals_the_library(live_server: Any, client: EngineClient,
                                             node_modules: Path) -> None:  # noqa: F811
    expected = _in_process(live_server)
    turns = [part for m in MESSAGES for part in (m["role"], m["content"])]
    done = subprocess.run(
        [_tool("node"), str(Path(__file__).parent / "polyglot" / "chat.js"), live_server.target,
         str(REPO / "protos"), str(PARAMS.max_tokens), *turns],
        env={**os.environ, "NODE_PATH": str(node_modules)},
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["tokens"] == expected.outputs[0].token_ids
    assert result["promptTokens"] == len(expected.prompt_token_ids)


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("messages", "kwargs", "field"), [
    ([], {}, "request.chat.messages"),
    ([{"role": "", "content": "hi"}], {}, "request.chat.messages[0].role"),
    # The renderer's own names: "messages" was a TypeError (UNKNOWN), and
    # "chat_template" would have rendered a template the client wrote.
    (HI, {"messages": "x"}, "request.chat.template_kwargs"),
    (HI, {"chat_template": "{{ 7 * 7 }}"}, "request.chat.template_kwargs"),
])
def test_bad_chat_input_names_the_field(client: EngineClient, messages: list[dict[str, str]],
                                        kwargs: dict[str, Any], field: str) -> None:
    from generated.esurge.v1 import engine_pb2
    from service.client import build_request

    request = build_request("x", PARAMS)
    request.ClearField("prompt_text")
    request.chat.CopyFrom(engine_pb2.ChatInput(
        messages=[engine_pb2.ChatMessage(**m) for m in messages]))
    request.chat.template_kwargs.update(kwargs)
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate(request))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    status = status_from_rpc_error(info.value)
    assert status is not None
    assert [v.field for v in field_violations(status)] == [field]


def test_a_model_without_a_template_refuses_chat(live_server: Any) -> None:
    engine = live_server.engine
    inputs = InputProcessor(engine.tokenizer, engine.model.vocab_size,
                            engine.model.eos_token_ids, 512, chat_template=None)
    with pytest.raises(InvalidRequestError) as info:
        inputs.prepare("r", ChatPrompt.of(MESSAGES), PARAMS)
    assert info.value.field == "chat"
    from generated.esurge.v1 import engine_pb2

    msg = engine_pb2.EngineRequest(chat=engine_pb2.ChatInput(
        messages=[engine_pb2.ChatMessage(role="user", content="hi")]))
    violation = engine_error_violation(info.value, engine_request_from_proto(msg), "request")
    assert violation.field == "request.chat"
