"""The shipped Eagle head for the default model: on held-out prompts it accepts enough
drafts (mean acceptance length >= 2.5 at k = 4) and greedy output is token-identical
to the plain engine's."""

from __future__ import annotations

from pathlib import Path

from esurge import CacheConfig, Config, SamplingParams, SchedulerConfig, SpeculativeConfig, eSurge

REPO = Path(__file__).resolve().parents[2]
MODEL, HEAD = REPO / "models" / "tiny-stdlib", REPO / "models" / "tiny-stdlib-eagle"
K = 4
NEW_TOKENS = 64



def test_the_shipped_checkpoints_are_present() -> None:
    # They ship with the repository: missing is a defect, never a skip.
    assert (MODEL / "model.safetensors").is_file(), f"{MODEL} has no model.safetensors"
    assert (HEAD / "config.json").is_file(), f"{HEAD} has no config.json"


def held_out_prompts(count: int) -> list[list[int]]:
    from bench.spec_decode import held_out_prompts as cut

    return cut(MODEL, count, seed=123)


def config(spec: SpeculativeConfig | None) -> Config:
    return Config(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                        chunked_prefill_enabled=True, max_num_seq_buckets=(8,)),
        CacheConfig(num_pages=160, page_size=16, enable_prefix_caching=True), spec)


def test_trained_head_acceptance_and_exact_tokens() -> None:
    prompts = held_out_prompts(8)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with eSurge(MODEL, config(SpeculativeConfig(K, str(HEAD))), show_progress=False,
                warmup=False, min_token_bucket=64) as llm:
        spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.runner.spec_stats
    with eSurge(MODEL, config(None), show_progress=False, warmup=False,
                min_token_bucket=64) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert spec == plain
    assert stats is not None
    print(f"tiny-stdlib-eagle: mean acceptance length {stats.mean_acceptance_length:.2f} at k={K}, "
          f"acceptance rate {stats.acceptance_rate:.2f}")
    assert stats.mean_acceptance_length >= 2.5
