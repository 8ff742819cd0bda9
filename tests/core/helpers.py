"""Builders shared by the KV cache tests."""

from __future__ import annotations

from esurge.core import (
    CacheGroupsConfig,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheManager,
    SlidingWindowSpec,
)
from esurge.request import EngineRequest
from esurge.sampling_params import SamplingParams


def full(page_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(page_size=page_size, num_kv_heads=1, head_dim=8)


def sliding(page_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(page_size=page_size, num_kv_heads=1, head_dim=8,
                             sliding_window=window)


def chunked(page_size: int, chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(page_size=page_size, num_kv_heads=1, head_dim=8,
                                     attention_chunk_size=chunk)


def groups_config(num_pages: int, *specs: FullAttentionSpec) -> CacheGroupsConfig:
    """One single-layer group per spec, in order."""
    groups = tuple(KVCacheGroup((i,), spec) for i, spec in enumerate(specs))
    return CacheGroupsConfig(num_pages=num_pages, groups=groups)


def manager(num_pages: int, *specs: FullAttentionSpec, max_model_len: int = 256,
            enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(groups_config(num_pages, *specs), max_model_len, enable_caching)


def request(request_id: str, tokens: list[int], cache_salt: str | None = None,
            prompt_logprobs: int | None = None) -> EngineRequest:
    params = SamplingParams(prompt_logprobs=prompt_logprobs)
    return EngineRequest(request_id, list(tokens), params, eos_token_id=None,
                         cache_salt=cache_salt)


def prefill(kv: KVCacheManager, req: EngineRequest, sampled: int | None = None) -> int:
    """Schedule the whole remaining prompt at once (with prefix hits), then append the
    sampled token if given; returns the hit tokens."""
    hits, num_hit = kv.get_computed_pages(req)
    new = kv.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    if sampled is not None:
        req.append_output_token_ids([sampled])
    return num_hit


def decode_step(kv: KVCacheManager, req: EngineRequest, sampled: int) -> None:
    """Compute the last sampled token and append the next one."""
    assert req.num_computed_tokens == req.num_tokens - 1
    assert kv.allocate_slots(req, 1) is not None
    req.num_computed_tokens += 1
    req.append_output_token_ids([sampled])


def held_pages(kv: KVCacheManager, request_id: str, group: int) -> list[int]:
    return [p for p in kv.get_pages(request_id).page_ids[group] if p != 0]
