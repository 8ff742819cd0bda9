"""What real decode steps cost beyond the parts warm-up measured, by batch size.

Warm-up times the device work of each step shape (`StepCosts`); a real step
also pays the loop's host work, which grows with the batch (scheduling,
each request's output and detokenization: SmolLM2 bf16 on a 2-core CPU,
0.2-0.4 ms over warm-up's cost at batch 1, 2.0-2.5 ms at batch 4) and which
both modes pay alike. A speculative step pays more besides (it is read
before the next is scheduled unless it hands its drafts ahead, and its host
work is larger). So a plain step's excess is kept per batch size, and a
speculative one's as what it adds to the plain excess at its batch size:
one figure learnt at batch 1, where requests try drafting, applies at
batch 4 on top of batch 4's own host work. Kept as one excess per mode for
every batch size, the plain steps of a batch of 4 (2.5 ms) against the
speculative ones of batch 1 (1.2 ms) made speculation at 4 look cheaper
than it is (1.38x predicted where the policy asks 1.2x), and trials ran
there on random-token prompts (`bench/spec_decode.py`: 0.87x of plain
decoding at batch 4). Each figure is the median of its last `window` samples: a few
slow steps (a collector's pause, a busy neighbour) must not move it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["StepOverheads"]


@dataclass(slots=True)
class StepOverheads:
    """Seconds a real step costs beyond its measured part: plain steps' by batch
    size, speculative ones' as an extra over the plain figure."""

    window: int = 33
    _plain: dict[int, deque[float]] = field(default_factory=dict, repr=False)
    _extra: deque[float] = field(init=False, repr=False)
    # Medians computed when read after new samples (every plain step is
    # observed, on the thread that dispatches the next one); None: the extra's.
    _medians: dict[int | None, float] = field(default_factory=dict, repr=False)
    # The measured batch size standing for each unmeasured one asked about
    # (cleared when a size is first measured): asked several times a step.
    _nearest: dict[int, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window!r}")
        self._extra = deque(maxlen=self.window)

    def plain(self, batch: int) -> float:
        """A plain step's excess at this batch size: that of the nearest batch
        size measured (by ratio, the smaller on a tie), 0.0 before any."""
        if not self._plain:
            return 0.0
        if batch in self._plain:
            return self._median(batch)
        nearest = self._nearest.get(batch)
        if nearest is None:
            nearest = self._nearest[batch] = min(
                self._plain, key=lambda b: (abs(math.log2(b / batch)), b))
        return self._median(nearest)

    def speculative(self, batch: int) -> float:
        """A speculative step's excess at this batch size."""
        return max(0.0, self.plain(batch) + self._median(None))

    def observe(self, batch: int, speculative: bool, excess: float) -> None:
        """One measured step's seconds beyond its measured part."""
        if speculative:
            self._extra.append(excess - self.plain(batch))
            self._medians.pop(None, None)
            return
        recent = self._plain.get(batch)
        if recent is None:
            recent = self._plain[batch] = deque(maxlen=self.window)
            self._nearest.clear()
        recent.append(excess)
        self._medians.pop(batch, None)

    def _median(self, key: int | None) -> float:
        median = self._medians.get(key)
        if median is None:
            recent = self._extra if key is None else self._plain[key]
            median = self._medians[key] = statistics.median(recent) if recent else 0.0
        return median
