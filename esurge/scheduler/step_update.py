"""Applying one step's model-runner output to the requests it ran.

Kept apart from the scheduler so the per-token rules (speculative rollback,
async placeholders, stop conditions, truncation, logprobs) read as one unit.
`StepUpdate` only touches the requests; the scheduler then frees the pages and
queue slots of those it reports finished.
"""

from __future__ import annotations

from esurge.engine_types import EngineCoreOutput, EngineCoreOutputs
from esurge.outputs import ModelRunnerOutput, TokenLogprobs
from esurge.request import EngineRequest, EngineRequestStatus
from esurge.scheduler.output import SchedulerOutput
from esurge.scheduler.stopping import check_stop

__all__ = ["StepUpdate"]

_RUNNING = EngineRequestStatus.RUNNING


class StepUpdate:
    """The outputs and finished requests of one `update_from_output` call."""

    __slots__ = ("_async", "_max_model_len", "_requests", "finished", "finished_ids",
                 "finished_running", "finished_waiting", "outputs")

    def __init__(self, requests: dict[str, EngineRequest], max_model_len: int,
                 async_scheduling: bool) -> None:
        self._requests = requests
        self._max_model_len = max_model_len
        self._async = async_scheduling
        self.outputs: dict[int, list[EngineCoreOutput]] = {}
        self.finished: list[EngineRequest] = []
        self.finished_running: set[EngineRequest] = set()
        self.finished_waiting: set[EngineRequest] = set()
        self.finished_ids: dict[int, set[str]] = {}

    def apply(self, scheduler_output: SchedulerOutput,
              model_runner_output: ModelRunnerOutput) -> None:
        """Append every scheduled live request's sampled tokens and build its output."""
        requests = self._requests
        index = model_runner_output.req_id_to_index
        sampled = model_runner_output.sampled_token_ids
        drafts_out = model_runner_output.spec_token_ids
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
        for rid in scheduler_output.num_scheduled_tokens:
            request = requests.get(rid)
            if request is None:
                continue  # ended after it was scheduled: its late tokens are dropped
            i = index.get(rid)
            if i is None:
                raise ValueError(f"model runner output has no row for scheduled request {rid!r}")
            new_ids = sampled[i]
            status = request.status
            num_draft = num_accepted = 0
            if spec_scheduled and rid in spec_scheduled:
                num_draft, num_accepted = self._verify(request, len(spec_scheduled[rid]),
                                                       len(new_ids))
            elif len(new_ids) > scheduler_output.num_decode_steps:
                raise ValueError(f"request {rid!r} got {len(new_ids)} sampled tokens in a "
                                 f"step of {scheduler_output.num_decode_steps} decode "
                                 "iteration(s) without draft tokens to verify")
            stopped = False
            if new_ids:
                if self._async:
                    # A verified step held a placeholder for each draft too.
                    request.num_output_placeholders = max(
                        0, request.num_output_placeholders - len(new_ids)
                        - (num_draft - num_accepted))
                if len(new_ids) == 1:
                    request.append_output_token_ids(new_ids)
                    stopped = check_stop(request, self._max_model_len)
                else:
                    stopped, new_ids = self._append_many(request, new_ids)
            if stopped:
                self.finished.append(request)
                (self.finished_running if status is _RUNNING else self.finished_waiting).add(
                    request)
            elif drafts_out is not None and status is _RUNNING:
                if not request.num_output_placeholders:
                    request.spec_token_ids = drafts_out[i]
                elif not drafts_out[i]:
                    # The runner stopped the request's drafts: those a later step
                    # handed ahead (Scheduler.take_drafts) are not verified either.
                    request.spec_token_ids = []
                # Other drafts proposed while a later step of the request is
                # already scheduled would follow the wrong tokens: dropped.
            step_prompt_logprobs = prompt_logprobs.get(rid) if prompt_logprobs else None
            if new_ids or stopped or step_prompt_logprobs is not None:
                token_logprobs = logprobs[i] if logprobs is not None else None
                self._emit(request, new_ids, stopped, token_logprobs, step_prompt_logprobs,
                           num_draft, num_accepted)

    @staticmethod
    def _verify(request: EngineRequest, num_draft: int, num_sampled: int) -> tuple[int, int]:
        """Roll num_computed_tokens back over the rejected drafts: (drafted, accepted)."""
        if num_sampled > num_draft + 1:
            raise ValueError(f"request {request.request_id!r} got {num_sampled} sampled tokens "
                             f"for {num_draft} drafts (at most drafts + 1)")
        num_accepted = max(num_sampled - 1, 0)
        if request.status is _RUNNING:
            request.num_computed_tokens -= num_draft - num_accepted
        return num_draft, num_accepted

    def _append_many(self, request: EngineRequest, new_ids: list[int]
                     ) -> tuple[bool, list[int]]:
        """Append tokens one at a time; a stop drops the tokens after it."""
        for k in range(len(new_ids)):
            request.append_output_token_ids(new_ids[k:k + 1])
            if check_stop(request, self._max_model_len):
                return True, new_ids[:k + 1]
        return False, new_ids

    def _emit(self, request: EngineRequest, new_ids: list[int], stopped: bool,
              token_logprobs: list[TokenLogprobs] | None,
              prompt_logprobs: list[TokenLogprobs | None] | None,
              num_draft: int, num_accepted: int) -> None:
        if token_logprobs is not None and len(token_logprobs) > len(new_ids):
            token_logprobs = token_logprobs[:len(new_ids)]
        # Positional in field order: keyword calls cost twice as much, and this
        # runs once per request per step.
        output = EngineCoreOutput(
            request.request_id,
            new_ids,
            token_logprobs,
            prompt_logprobs,
            request.get_finished_reason() if stopped else None,
            request.stop_reason,
            request.num_cached_tokens or 0,
            request.take_events(),
            num_draft,
            num_accepted,
        )
        self._add(request, output, stopped)

    def add_final(self, request: EngineRequest) -> None:
        """The last output of a request ended from outside (abort, stop string)."""
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.get_finished_reason(),
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens or 0,
            events=request.take_events(),
        )
        self._add(request, output, True)

    def _add(self, request: EngineRequest, output: EngineCoreOutput, finished: bool) -> None:
        client = request.client_index
        outputs = self.outputs.get(client)
        if outputs is None:
            outputs = self.outputs[client] = []
        outputs.append(output)
        if finished:
            ids = self.finished_ids.get(client)
            if ids is None:
                ids = self.finished_ids[client] = set()
            ids.add(request.request_id)

    def collect(self, include_finished_set: bool, timestamp: float) -> dict[int, EngineCoreOutputs]:
        """One EngineCoreOutputs per client that has outputs in this update."""
        return {
            client: EngineCoreOutputs(
                outputs=outputs,
                timestamp=timestamp,
                finished_requests=(self.finished_ids.get(client, set())
                                   if include_finished_set else None),
            )
            for client, outputs in self.outputs.items()
        }
