"""KV cache bookkeeping: page pool, prefix cache and cache groups (pure Python)."""

from esurge.core.kv_cache_manager import KVCacheManager, KVCachePages
from esurge.core.kv_cache_spec import (
    AttentionSpec,
    CacheGroupsConfig,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    SlidingWindowSpec,
    cache_groups_from_hf_config,
)
from esurge.core.page_pool import PagePool

__all__ = [
    "AttentionSpec",
    "CacheGroupsConfig",
    "ChunkedLocalAttentionSpec",
    "FullAttentionSpec",
    "KVCacheGroup",
    "KVCacheManager",
    "KVCachePages",
    "PagePool",
    "SlidingWindowSpec",
    "cache_groups_from_hf_config",
]
