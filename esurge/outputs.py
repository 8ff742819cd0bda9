"""What the model runner returns from one step, and the logprobs container."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np

__all__ = ["DeviceDrafts", "ModelRunnerOutput", "TokenLogprobs"]


class DeviceDrafts(Sequence[int]):
    """A request's draft tokens while they are still on the device.

    A speculative step hands its proposals back as soon as its verification
    is read, while the device still drafts: the engine schedules the next
    step meanwhile, which needs how many drafts each request has, not which.
    The runner that proposed them feeds them to that step from the device
    (`handle` is its own mark of where they are); whoever reads a value
    (a grammar check, a multi-host comparison) waits for the device once.
    Slicing keeps them on the device.
    """

    __slots__ = ("_count", "_read", "handle")

    def __init__(self, read: Callable[[], Sequence[int] | np.ndarray], count: int,
                 handle: object) -> None:
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count!r}")
        self._read = read  # the proposing row's values (at least count of them)
        self._count = count
        self.handle = handle

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._count)
            if start == 0 and step == 1:  # a prefix stays on the device
                return DeviceDrafts(self._read, stop, self.handle)
            return self.values()[index]
        return self.values()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.values())

    def values(self) -> list[int]:
        """The drafts as ints (waits for the device the first time any is read)."""
        return [int(t) for t in self._read()[:self._count]]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DeviceDrafts | list | tuple):
            return self.values() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.values())

    def __reduce__(self) -> tuple[type[list[int]], tuple[list[int]]]:
        # Another process (a multi-host follower) gets the values.
        return list, (self.values(),)


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
    proposed for the next step (DeviceDrafts while the device drafts them).
    logprobs[i] has one entry per sampled token when the request asked for
    logprobs. prompt_logprobs maps a request to the prompt positions computed
    this step.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    spec_token_ids: list[Sequence[int]] | None = None
    logprobs: list[list[TokenLogprobs] | None] | None = None
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        """The output of a step that ran no request."""
        return cls(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
