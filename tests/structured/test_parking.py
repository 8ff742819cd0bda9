"""A request whose grammar is still compiling waits outside the scheduler:
others run meanwhile; it starts once the grammar is ready, or is refused
when it is not ready in time, or is dropped when aborted."""

from __future__ import annotations

import queue
import time
from concurrent.futures import CancelledError, Future
from typing import Any

import pytest

from esurge import SamplingParams, StructuredOutputsParams
from esurge.engine.request_output import RequestOutput
from esurge.errors import InvalidRequestError

SO = StructuredOutputsParams(choice=("left", "right"))


def _submit(engine: Any, rid: str, params: SamplingParams, grammar: Future[Any] | None,
            timeout: float = 30.0) -> tuple[Future[None], queue.SimpleQueue[Any]]:
    """Submit through the engine loop with a grammar future the test holds."""
    results: queue.SimpleQueue[Any] = queue.SimpleQueue()
    prepared = engine.inputs.prepare(rid, [5, 6, 7], params)
    eos = engine.inputs.eos_token_id
    accepted = engine.loop.submit(rid, None, prepared.prompt_token_ids, prepared.params,
                                  lambda ids: prepared.engine_requests(ids, eos), results.put,
                                  True, grammar, timeout)
    return accepted, results


def test_a_compiling_request_holds_nobody_back(random_engine: Any) -> None:
    compiled = random_engine.grammars.compile(SO).result(timeout=30)
    held: Future[Any] = Future()
    waiting, waiting_out = _submit(random_engine, "parked", SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=SO), held)
    # ignore_eos: an unseeded sample may draw EOS early; the point is that it runs.
    free, free_out = _submit(random_engine, "free", SamplingParams(max_tokens=4, ignore_eos=True),
                             None)
    free.result(timeout=30)
    done: RequestOutput = free_out.get(timeout=30)
    assert done.finished and len(done.outputs[0].token_ids) == 4
    assert not waiting.done()  # still parked: not accepted, not refused
    held.set_result(compiled)
    waiting.result(timeout=30)
    reply: RequestOutput = waiting_out.get(timeout=30)
    assert reply.outputs[0].text in ("left", "right")


def test_a_grammar_late_past_its_deadline_is_refused(random_engine: Any) -> None:
    began = time.monotonic()
    late, _ = _submit(random_engine, "late", SamplingParams(max_tokens=4, structured_outputs=SO),
                      Future(), timeout=0.3)
    with pytest.raises(InvalidRequestError) as err:
        late.result(timeout=30)
    assert err.value.field == "sampling_params.structured_outputs.choice"
    assert 0.3 <= time.monotonic() - began < 10


def test_an_abort_while_compiling_drops_the_request(random_engine: Any) -> None:
    held: Future[Any] = Future()
    parked, out = _submit(random_engine, "dropped", SamplingParams(
        max_tokens=4, structured_outputs=SO), held)
    random_engine.abort("dropped")  # queued behind the submit: the loop parked it first
    with pytest.raises(CancelledError):
        parked.result(timeout=30)
    # The grammar's arrival is queued before the next request, which the loop
    # takes in order: once that one is done, the dropped one had its chance.
    held.set_result(random_engine.grammars.compile(SO).result(timeout=30))
    after, after_out = _submit(random_engine, "after", SamplingParams(max_tokens=2), None)
    after.result(timeout=30)
    after_out.get(timeout=30)
    assert out.empty() and random_engine.stats.num_running == 0
