"""Eagle speculative decoding: draft heads, their loader, the proposer and the verifier.

Switched on by the engine config:

    Config(..., speculative_config=SpeculativeConfig(num_speculative_tokens=4,
                                                     speculative_model="models/tiny-stdlib-eagle"))

A speculative step verifies the drafts of the previous step in the target's
forward (greedy: token-identical to plain decoding; sampling: speculative
rejection sampling, so the output distribution is exactly the target's, with
per-request seeds honoured) and drafts k new tokens per request from the
target's hidden states. Which steps speculate is the policy's choice
(`esurge.spec_decode.policy`, EngineSettings.speculation): by default only at
batch sizes where speculative steps measurably beat plain ones. Speculative
steps do not pipeline: with `async_scheduling=True` the engine collects
each speculative step before scheduling the next (it dispatches that next
step before handing the outputs back, so their processing overlaps the
device), while its plain steps overlap like any engine's (same tokens
either way). Requests whose sampling needs
per-token host state (penalties, logit bias, allowed/bad words, min_tokens)
run without drafts.

Metrics: every `EngineCoreOutput` carries `num_draft_tokens` and
`num_accepted_tokens` for its step (summed per sample in `CompletionOutput`),
and `eSurgeRunner.spec_stats` (`eSurge.runner.spec_stats`) returns a
`SpecStatsSnapshot` of engine-wide counters (verifications, drafted,
accepted, acceptance rate, mean acceptance length), None with speculation
off; it is safe to read from any thread.
"""

from esurge.spec_decode.checkpoint import eagle_config_dict, load_eagle_head, save_eagle_head
from esurge.spec_decode.config import EagleConfig, EagleLayout
from esurge.spec_decode.head import EagleHead, EagleState, init_head
from esurge.spec_decode.proposer import DraftKVCache, init_draft_cache, propose
from esurge.spec_decode.rejection import accept_greedy, rejection_sample
from esurge.spec_decode.stats import SpecDecodeStats, SpecStatsSnapshot

__all__ = [
    "DraftKVCache",
    "EagleConfig",
    "EagleHead",
    "EagleLayout",
    "EagleState",
    "SpecDecodeStats",
    "SpecStatsSnapshot",
    "accept_greedy",
    "eagle_config_dict",
    "init_draft_cache",
    "init_head",
    "load_eagle_head",
    "propose",
    "rejection_sample",
    "save_eagle_head",
]
