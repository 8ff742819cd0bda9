"""Attention cache specs per layer, and how layers are grouped over one page pool.

Layers are grouped by attention type. Every group holds the same number of
layers (`group_size`, the smaller groups padded), and all groups draw page ids
from one shared pool. The device cache therefore holds `group_size` "slots",
each an array over all `num_pages` pages; layer `i` of a group reads and writes
slot `i` through that group's own page table. A page id belongs to one group at
a time, so groups never collide, and a sliding-window group that frees pages
outside its window really frees memory for the other groups: the cache costs
`num_pages * group_size` layer-pages rather than `num_pages * num_layers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "AttentionSpec",
    "CacheGroupsConfig",
    "ChunkedLocalAttentionSpec",
    "FullAttentionSpec",
    "KVCacheGroup",
    "SlidingWindowSpec",
    "cache_groups_from_hf_config",
    "layer_specs_from_hf_config",
]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """What every layer's cache has: page geometry and element type.

    The kinds (full, sliding window, chunked local) are siblings under this
    base, so `isinstance` tells them apart; each says which positions a
    query still attends to.
    """

    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _positive("page_size", self.page_size)
        _positive("num_kv_heads", self.num_kv_heads)
        _positive("head_dim", self.head_dim)
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def page_bytes(self) -> int:
        """Bytes of K and V for one page of one layer."""
        return 2 * self.page_size * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]

    def first_needed_token(self, num_computed_tokens: int) -> int:
        """Earliest position a query at num_computed_tokens (or later) can attend to."""
        raise NotImplementedError(f"{type(self).__name__} must say which positions it reads")


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole sequence."""

    def first_needed_token(self, num_computed_tokens: int) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(AttentionSpec):
    """Causal attention over the last `sliding_window` positions (the query's own included)."""

    sliding_window: int = 0

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        _positive("sliding_window", self.sliding_window)

    def first_needed_token(self, num_computed_tokens: int) -> int:
        # The next query sits at position num_computed_tokens and sees
        # positions > num_computed_tokens - sliding_window.
        return max(0, num_computed_tokens - self.sliding_window + 1)


@dataclass(frozen=True, slots=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Causal attention within fixed chunks of `attention_chunk_size` positions."""

    attention_chunk_size: int = 0

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        _positive("attention_chunk_size", self.attention_chunk_size)

    def first_needed_token(self, num_computed_tokens: int) -> int:
        chunk = self.attention_chunk_size
        return (num_computed_tokens // chunk) * chunk


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers sharing one attention spec and one page table per request.

    layer_ids[i] uses cache slot i. A padded group lists fewer layers than
    group_size; its unused slots stay idle for its pages.
    """

    layer_ids: tuple[int, ...]
    spec: AttentionSpec

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise ValueError("layer_ids must name at least one layer")
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))


@dataclass(frozen=True, slots=True)
class CacheGroupsConfig:
    """The page pool size and the layer groups drawing from it."""

    num_pages: int
    groups: tuple[KVCacheGroup, ...]

    def __post_init__(self) -> None:
        _positive("num_pages", self.num_pages)
        groups = tuple(self.groups)
        if not groups:
            raise ValueError("groups must hold at least one KVCacheGroup")
        page_sizes = {g.spec.page_size for g in groups}
        if len(page_sizes) != 1:
            raise ValueError(f"all groups must share one page_size, got {sorted(page_sizes)}")
        seen: set[int] = set()
        for g in groups:
            dup = seen.intersection(g.layer_ids)
            if dup:
                raise ValueError(f"layer ids {sorted(dup)} appear in more than one group")
            seen.update(g.layer_ids)
        object.__setattr__(self, "groups", groups)

    @property
    def page_size(self) -> int:
        """Tokens per page, shared by all groups."""
        return self.groups[0].spec.page_size

    @property
    def group_size(self) -> int:
        """Cache slots: the most layers any group holds."""
        return max(len(g.layer_ids) for g in self.groups)

    @property
    def num_layers(self) -> int:
        """Layers covered by all groups."""
        return sum(len(g.layer_ids) for g in self.groups)

    def layer_location(self, layer_id: int) -> tuple[int, int]:
        """(group index, slot index) of a layer."""
        for gi, group in enumerate(self.groups):
            if layer_id in group.layer_ids:
                return gi, group.layer_ids.index(layer_id)
        raise ValueError(f"layer_id {layer_id} is in no cache group")

    @property
    def bytes_per_page(self) -> int:
        """Device bytes one page id costs across all slots."""
        return max(g.spec.page_bytes for g in self.groups) * self.group_size


def _attr(config: Any, name: str) -> Any:
    return getattr(config, name, None)


def layer_specs_from_hf_config(
    hf_config: Any, page_size: int, dtype: str = "float32", num_kv_heads: int | None = None
) -> list[AttentionSpec]:
    """One attention spec per decoder layer, read from a Hugging Face config.

    Understands `layer_types` (full / sliding / chunked attention, as recent
    transformers configs spell them), a model-wide `sliding_window` (Mistral;
    Qwen2 only with `use_sliding_window`) and `attention_chunk_size`.
    num_kv_heads overrides the config's (a tensor-parallel layout replicates
    kv heads up to the shards).
    """
    text = _attr(hf_config, "text_config") or hf_config
    num_layers = int(text.num_hidden_layers)
    num_heads = int(text.num_attention_heads)
    kv_heads = num_kv_heads or int(_attr(text, "num_key_value_heads") or num_heads)
    head_dim = int(_attr(text, "head_dim") or text.hidden_size // num_heads)
    full = FullAttentionSpec(page_size, kv_heads, head_dim, dtype)
    window = _attr(text, "sliding_window")
    chunk = _attr(text, "attention_chunk_size")

    def by_type(kind: str) -> AttentionSpec:
        if kind == "sliding_attention" and window:
            return SlidingWindowSpec(page_size, kv_heads, head_dim, dtype, int(window))
        if kind == "chunked_attention" and chunk:
            return ChunkedLocalAttentionSpec(page_size, kv_heads, head_dim, dtype, int(chunk))
        if kind in ("full_attention", "sliding_attention", "chunked_attention"):
            return full
        raise ValueError(f"layer_types holds an unknown attention type {kind!r}")

    layer_types = _attr(text, "layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(
                f"layer_types has {len(layer_types)} entries for {num_layers} layers"
            )
        return [by_type(str(kind)) for kind in layer_types]
    if window and _attr(text, "use_sliding_window") is not False:
        return [SlidingWindowSpec(page_size, kv_heads, head_dim, dtype, int(window))] * num_layers
    if chunk:
        chunked = ChunkedLocalAttentionSpec(page_size, kv_heads, head_dim, dtype, int(chunk))
        return [chunked] * num_layers
    return [full] * num_layers


def group_layer_specs(specs: list[AttentionSpec]) -> list[KVCacheGroup]:
    """Group layers by spec into groups of equal size (the smallest type count).

    Layers of one spec are cut into consecutive runs of group_size, so a model
    whose layers all share a spec becomes a single group.
    """
    by_spec: dict[AttentionSpec, list[int]] = {}
    for layer_id, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(layer_id)
    group_size = min(len(ids) for ids in by_spec.values())
    if len(by_spec) == 1:
        group_size = len(specs)
    groups: list[KVCacheGroup] = []
    for spec, ids in by_spec.items():
        for start in range(0, len(ids), group_size):
            groups.append(KVCacheGroup(tuple(ids[start:start + group_size]), spec))
    return groups


def cache_groups_from_hf_config(
    hf_config: Any, num_pages: int, page_size: int, dtype: str = "float32",
    num_kv_heads: int | None = None,
) -> CacheGroupsConfig:
    """The cache groups of a Hugging Face model config over a pool of num_pages."""
    specs = layer_specs_from_hf_config(hf_config, page_size, dtype, num_kv_heads)
    return CacheGroupsConfig(num_pages=num_pages, groups=tuple(group_layer_specs(specs)))
