"""The runner's side of Eagle speculative decoding: the step kind, the draft
head's per-step driver and draft verification.

The head, its proposer and the rejection rule are below the runner, in
`esurge.spec_decode`.
"""

from esurge.runner.steps.speculative.kind import SpeculativeStep

__all__ = ["SpeculativeStep"]
