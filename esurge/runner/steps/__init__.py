"""Step kinds: each way the runner can run a step, with its dispatch, collect
and warm-up programs (see `base.StepKind`)."""
