"""What the model runner returns from one step, and the logprobs container."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["ModelRunnerOutput", "TokenLogprobs"]


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities at one position.

    token_ids[0] / logprobs[0] are the chosen token (sampled, or the prompt
    token for prompt logprobs); the rest are the top-n alternatives in order.
    rank is the chosen token's 1-based rank in the full distribution.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    rank: int

    @classmethod
    def from_row(cls, token_ids: Sequence[int], logprobs: Sequence[float], rank: int,
                 top_n: int) -> TokenLogprobs:
        """The chosen token and its top_n alternatives from one row of the
        device arrays ([1 + MAX_LOGPROBS] ids and log-probabilities)."""
        return cls(tuple(int(t) for t in token_ids[:1 + top_n]),
                   tuple(float(x) for x in logprobs[:1 + top_n]), int(rank))

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs) or not self.token_ids:
            raise ValueError(
                f"token_ids and logprobs must be non-empty and of equal length, got "
                f"{len(self.token_ids)} and {len(self.logprobs)}"
            )


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step's results, row-aligned with `req_ids`.

    sampled_token_ids[i] holds one token normally, up to 1 + k with speculative
    decoding (accepted drafts plus the bonus token), and none for a request
    still in the middle of a chunked prefill. spec_token_ids[i] are the drafts
    proposed for the next step. logprobs[i] has one entry per sampled token
    when the request asked for logprobs. prompt_logprobs maps a request to the
    prompt positions computed this step.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    spec_token_ids: list[list[int]] | None = None
    logprobs: list[list[TokenLogprobs] | None] | None = None
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        """The output of a step that ran no request."""
        return cls(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
