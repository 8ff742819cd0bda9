"""A stream that fell behind sends one message per sample for the steps it missed."""

from __future__ import annotations

from esurge.engine.request_output import CompletionDelta, RequestDelta
from esurge.engine_types import FinishReason
from generated.esurge.v1 import engine_pb2
from service.responses import RequestCursor, coalesce


def _step(index: int, tokens: tuple[int, ...], total: int, *, first: bool = False,
          finish: FinishReason | None = None, drafts: int = 0) -> RequestDelta:
    comp = CompletionDelta(index=index, token_ids=tokens, text="".join(f"<{t}>" for t in tokens),
                           logprobs=(), events=(), num_tokens=total, num_draft_tokens=drafts,
                           num_accepted_tokens=drafts // 2, finish=finish,
                           stop_reason=None)
    return RequestDelta("r", (comp,), finished=finish is not None, first=first,
                        prompt_token_ids=(1, 2, 3))


def test_missed_steps_become_one_part_per_sample() -> None:
    cursor = RequestCursor("r", n=2)
    steps = [_step(0, (5,), 1, first=True), _step(1, (6,), 1), _step(0, (7, 8), 3, drafts=4),
             _step(1, (9,), 2, finish=FinishReason.LENGTH), _step(0, (10,), 4)]
    parts = coalesce([p for s in steps for p in cursor.advance(s)])
    assert [p.index for p in parts] == [0, 1]
    zero, one = parts
    assert (tuple(zero.token_ids), zero.text, zero.first) == ((5, 7, 8, 10), "<5><7><8><10>", True)
    assert (zero.num_draft_tokens, zero.num_accepted_tokens, zero.completion_tokens) == (4, 2, 4)
    assert zero.finish_reason == engine_pb2.FINISH_REASON_UNSPECIFIED
    assert (tuple(one.token_ids), one.first, one.completion_tokens) == ((6, 9), True, 2)
    assert one.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    # the message of the ended sample carries its usage, the other none yet
    message = cursor.generate_response(one, with_prompt_ids=False,
                                       total_drafts=cursor.sample_totals(1))
    assert message.usage.completion_tokens == 2 and message.prompt_info.num_prompt_tokens == 3


def test_a_stream_that_keeps_up_is_unchanged() -> None:
    cursor = RequestCursor("r", n=1)
    part = cursor.advance(_step(0, (5,), 1, first=True))
    assert coalesce(part) == part
    assert coalesce([]) == []
