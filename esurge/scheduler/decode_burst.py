"""Decode bursts: several decode iterations of every running request in one step.

On a small model the engine's per-step host work (scheduling, input building,
the device call, output processing) costs about as much CPU as the forward
pass itself, and on a CPU host that work competes with the forward for the
same cores. A burst of K runs K decode iterations in one device call (the
tokens of iteration j feed iteration j + 1 on the device) and pays the host
work once.

A burst must not change what any request outputs, nor hold anyone back: it
is taken only when no request waits that could be admitted now (with the
batch full, a waiting request can only start when a running one ends, so a
burst is then taken only if no running request reaches max_tokens inside it),
and every running request is in plain decode (one token to compute, no drafts),
samples each token from its logits, seed and position alone with nothing else
asked per token (`SamplingParams.stateless_sampling`: greedy or sampled, no
penalties, masks or logprobs) and has room for K more positions before
max_model_len. A request with fewer than K tokens left to output, or that
stops inside a burst (EOS, a stop token or string), keeps only the tokens up
to its stop (the scheduler's stop check runs per token); the rest of its
burst is computed and discarded. Requests whose remaining tokens are all in
flight already (async scheduling) sit the burst out, as they would a plain
step. Every burst position gets its cache slot, so a burst only runs when the
free pages cover the most it can take: it never preempts where a plain step
would not have. What a burst can still do is end a request early inside it
(EOS, a stop) while the batch is full and others wait: its slot then stays
idle for the rest of the burst, at most K - 1 iterations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from esurge.request import EngineRequest
from esurge.settings import EngineSettings

__all__ = ["DecodeBurstPolicy", "check_decode_steps"]


def check_decode_steps(decode_steps: object, num_speculative_tokens: int) -> int:
    """decode_steps as an int >= 1; InvalidConfigError naming it otherwise, or when
    it is combined with speculative decoding (a step verifies drafts or bursts)."""
    settings = EngineSettings(decode_steps=decode_steps)  # type: ignore[arg-type]
    settings.check_speculation(num_speculative_tokens)
    return settings.decode_steps


class DecodeBurstPolicy:
    """Decides how many decode iterations the next step runs (1: a plain step)."""

    __slots__ = ("decode_steps", "max_model_len", "max_num_batched_tokens", "pages_per_request")

    def __init__(self, decode_steps: int, max_model_len: int, max_num_batched_tokens: int,
                 page_size: int, num_groups: int) -> None:
        self.decode_steps = check_decode_steps(decode_steps, 0)
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        # The most new pages a request can need for K more positions (per group,
        # a run of K positions crosses at most this many page starts).
        self.pages_per_request = num_groups * (1 + (decode_steps - 1) // page_size)

    def steps(self, running: Sequence[EngineRequest], num_waiting: int, batch_full: bool,
              num_free_pages: int, num_new_tokens: Callable[[EngineRequest], int]) -> int:
        """decode_steps when the running requests can take a burst, else 1.

        batch_full: no waiting request could be admitted now for want of a slot.
        num_new_tokens(request) is the scheduler's token count for a plain step.
        """
        k = self.decode_steps
        if (k == 1 or (num_waiting and not batch_full) or not running
                or k * len(running) > self.max_num_batched_tokens
                or num_free_pages < self.pages_per_request * len(running)):
            return 1
        last_position = self.max_model_len - 1
        decoding = False
        for request in running:
            if request.spec_token_ids or not request.sampling_params.stateless_sampling:
                return 1
            if request.num_computed_tokens + k > last_position:
                return 1
            max_tokens = request.sampling_params.max_tokens
            if num_waiting and max_tokens is not None and (
                    request.num_output_tokens + request.num_output_placeholders + k
                    > max_tokens):
                return 1  # it ends inside the burst: a waiting request takes its slot now
            num_new = num_new_tokens(request)
            if num_new > 1:
                return 1  # still in its prompt
            decoding = decoding or num_new == 1
        return k if decoding else 1
