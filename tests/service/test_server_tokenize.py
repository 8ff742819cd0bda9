"""Tokenizing a request happens off the event loop: other calls are answered meanwhile."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from esurge.sampling_params import SamplingParams
from service.client import EngineClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


class HeldTokenizer:
    """The engine's tokenizer, held inside encode_batch (what esurge.engine.tokenize
    calls) until the test releases it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode_batch(self, texts: list[str], *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        self.release.wait(20)
        return self.inner.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("where", ["prompt", "bad_words"])
def test_other_calls_are_served_while_a_request_tokenizes(
        live_server: Any, client: EngineClient, monkeypatch: pytest.MonkeyPatch,
        where: str) -> None:
    held = HeldTokenizer(live_server.engine.inputs.tokenizer)
    monkeypatch.setattr(live_server.engine.inputs, "tokenizer", held)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                            bad_words=("zebra",) if where == "bad_words" else ())
    prompt: Any = "def add(a, b):" if where == "prompt" else [5, 6, 7]
    answers: list[Any] = []
    caller = threading.Thread(target=lambda: answers.append(
        client.generate_unary(prompt, params)))
    caller.start()
    try:
        assert held.entered.wait(20)
        # The tokenizer is busy with that request; the server must still answer.
        with EngineClient(live_server.target, timeout=3) as quick:
            assert quick.health() == "SERVING"
            assert quick.load().num_running_requests == 0
    finally:
        held.release.set()
        caller.join(30)
    assert not caller.is_alive()
    assert len(answers[0].completions[0].token_ids) == 3
