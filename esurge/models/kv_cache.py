"""The device KV cache: `group_size` slots of paged keys and values, shared by all groups.

Layout follows `esurge.core.kv_cache_spec`: every cache group draws page ids
from one pool, so the cache holds `group_size` slots, each a K and a V array
of shape [num_pages, page_size, num_kv_heads, head_dim]; layer i of a group
reads and writes slot i through its group's page table. Page 0 is the null
page: padding tokens write there and unused page-table entries point there,
so it never holds anything a real token reads unmasked.

The cache is a pytree; its layout (which group and slot each layer uses, and
each layer's attention spec) is static data, so the jitted forward can be
donated the arrays and find its way in them without extra arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from esurge.core.kv_cache_spec import AttentionSpec, CacheGroupsConfig

__all__ = ["NULL_PAGE", "KVCache", "init_kv_cache", "placed_zeros"]

NULL_PAGE = 0
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """Paged keys and values per slot, plus the static map from layers to (group, slot)."""

    keys: tuple[jax.Array, ...]  # group_size x [num_pages, page_size, kv_heads, head_dim]
    values: tuple[jax.Array, ...]  # group_size x [num_pages, page_size, kv_heads, head_dim]
    layer_slots: tuple[tuple[int, int], ...] = field(metadata={"static": True})
    layer_specs: tuple[AttentionSpec, ...] = field(metadata={"static": True})

    @property
    def num_groups(self) -> int:
        """Cache groups (rows of the batch's slot mapping and page tables)."""
        return 1 + max(group for group, _ in self.layer_slots)

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return int(self.keys[0].shape[1])

    @property
    def num_pages(self) -> int:
        """Pages in the pool, the null page included."""
        return int(self.keys[0].shape[0])

    def replace_slot(self, slot: int, k: jax.Array, v: jax.Array) -> KVCache:
        """A cache with one slot's arrays swapped (used inside the jitted forward)."""
        keys = (*self.keys[:slot], k, *self.keys[slot + 1:])
        values = (*self.values[:slot], v, *self.values[slot + 1:])
        return KVCache(keys, values, self.layer_slots, self.layer_specs)


def _cache_dtype(dtype: str | jnp.dtype | None, config: CacheGroupsConfig) -> jnp.dtype:
    name = config.groups[0].spec.dtype if dtype is None else dtype
    if isinstance(name, str):
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
        return jnp.dtype(_DTYPES[name])
    return jnp.dtype(name)


def placed_zeros(shape: tuple[int, ...], dtype: jnp.dtype,
                 sharding: jax.sharding.Sharding | None) -> jax.Array:
    """Zeros on the default device, or made in place with `sharding`."""
    if sharding is None:
        return jnp.zeros(shape, dtype)
    # Made in place on each device: the whole array never exists on one.
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def init_kv_cache(
    cache_groups_config: CacheGroupsConfig, dtype: str | jnp.dtype | None = None,
    sharding: jax.sharding.Sharding | None = None,
) -> KVCache:
    """A zeroed device cache for the groups; dtype defaults to the groups' spec dtype.

    sharding places every slot (esurge.models.tensor_parallel.kv_cache_sharding);
    None: the default device."""
    groups = cache_groups_config.groups
    shapes = {(g.spec.num_kv_heads, g.spec.head_dim) for g in groups}
    if len(shapes) != 1:
        raise ValueError(
            f"all cache groups must share (num_kv_heads, head_dim) to share slots, got "
            f"{sorted(shapes)}"
        )
    kv_heads, head_dim = shapes.pop()
    num_layers = cache_groups_config.num_layers
    if sorted(i for g in groups for i in g.layer_ids) != list(range(num_layers)):
        raise ValueError(f"cache groups must cover layers 0..{num_layers - 1} exactly once")
    shape = (cache_groups_config.num_pages, cache_groups_config.page_size, kv_heads, head_dim)
    cache_dtype = _cache_dtype(dtype, cache_groups_config)
    slots = cache_groups_config.group_size
    layer_slots = tuple(cache_groups_config.layer_location(i) for i in range(num_layers))
    layer_specs = tuple(groups[g].spec for g, _ in layer_slots)
    return KVCache(
        keys=tuple(placed_zeros(shape, cache_dtype, sharding) for _ in range(slots)),
        values=tuple(placed_zeros(shape, cache_dtype, sharding) for _ in range(slots)),
        layer_slots=layer_slots,
        layer_specs=layer_specs,
    )
