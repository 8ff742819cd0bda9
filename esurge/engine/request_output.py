"""What the eSurge Python API returns: per-request results and timings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from esurge.engine_types import EngineCoreEvent, FinishReason
from esurge.outputs import TokenLogprobs

__all__ = ["CompletionDelta", "CompletionOutput", "RequestDelta", "RequestMetrics",
           "RequestOutput", "snapshot"]


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timings of one request (time.monotonic seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request (index < n).

    Cumulative: the whole sample so far (text is filled in once it ended).
    `finish` is why the sample ended (None while it runs); `finish_reason`
    is its name. Streaming callers get `CompletionDelta`s instead.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length" or "abort" once the sample ended (vLLM's names)."""
        return None if self.finish is None else str(self.finish)

    @property
    def finished(self) -> bool:
        """True once this sample has ended."""
        return self.finish is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's state as the caller sees it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: RequestMetrics | None = None


@dataclass(frozen=True, slots=True)
class CompletionDelta:
    """What one engine step added to one sample: new tokens, text, logprobs, events.

    num_tokens is the sample's token count so far (this delta's included);
    the draft counts are this step's.
    """

    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...]
    events: tuple[EngineCoreEvent, ...]
    num_tokens: int
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    finish: FinishReason | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        """True on the sample's last delta."""
        return self.finish is not None

    @property
    def delta_text(self) -> str:
        """The new text: `text` under the name streamed outputs used before deltas."""
        return self.text

    @property
    def delta_token_ids(self) -> tuple[int, ...]:
        """The new token ids: `token_ids` under the name streamed outputs used before."""
        return self.token_ids


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """What one engine step added to a request; streaming subscribers get these.

    outputs holds the samples the step touched. first marks the request's
    first delta, which carries num_cached_tokens; prompt_logprobs holds the
    entries new in this step (chunked prefill delivers them in parts).
    prompt_token_ids is the request's prompt, shared, never modified.
    """

    request_id: str
    outputs: tuple[CompletionDelta, ...]
    finished: bool
    first: bool
    prompt_token_ids: Sequence[int]
    num_cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()


def snapshot(output: RequestOutput) -> RequestOutput:
    """A copy another thread may keep while the original keeps changing."""
    completions = [
        CompletionOutput(
            index=c.index, text=c.text, token_ids=list(c.token_ids),
            finish=c.finish, stop_reason=c.stop_reason,
            logprobs=None if c.logprobs is None else list(c.logprobs),
            num_draft_tokens=c.num_draft_tokens, num_accepted_tokens=c.num_accepted_tokens,
        )
        for c in output.outputs
    ]
    metrics = output.metrics
    if metrics is not None:
        metrics = RequestMetrics(
            metrics.arrival_time, metrics.first_scheduled_time, metrics.first_token_time,
            metrics.last_token_time, metrics.finished_time, list(metrics.token_times))
    return RequestOutput(
        request_id=output.request_id, prompt=output.prompt,
        prompt_token_ids=output.prompt_token_ids, outputs=completions, finished=output.finished,
        num_cached_tokens=output.num_cached_tokens,
        prompt_logprobs=None if output.prompt_logprobs is None else list(output.prompt_logprobs),
        metrics=metrics,
    )
