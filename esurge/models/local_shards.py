"""Kernels that must run on their own shard, under the tracing context's mesh.

GSPMD partitions the model's JAX code by itself, but a custom call is opaque
to it: given sharded operands, it gathers them and runs the call whole on
every device. A kernel that is naturally per head (attention) is instead
wrapped in `shard_map` here, when the mesh the runner traces under
(`jax.set_mesh`) splits heads; without such a mesh it runs as is.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeVar

import jax
from jax.sharding import PartitionSpec

__all__ = ["TP_AXIS", "Split", "host_visible", "over_local_heads", "over_local_panels",
           "splits_over_tp"]

TP_AXIS = "tp"

AttentionCall = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
Tree = TypeVar("Tree")


def _tp_mesh() -> jax.sharding.AbstractMesh | None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TP_AXIS not in mesh.axis_names or mesh.shape[TP_AXIS] == 1:
        return None
    return mesh


def splits_over_tp() -> bool:
    """Whether the tracing context's mesh has a tp axis of more than one device."""
    return _tp_mesh() is not None


def host_visible(tree: Tree) -> Tree:
    """A step's outputs that the host reads (sampled tokens, logprobs), pinned
    replicated on the context mesh: every host of a multi-host job then holds
    the whole result and reads its own copy (esurge.runner.host_read)."""
    if _tp_mesh() is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, PartitionSpec()), tree)


def over_local_heads(call: AttentionCall, num_replicated: int) -> AttentionCall:
    """`call(q, k, v, slot_mapping, k_cache, v_cache, *replicated)` run per shard
    under the tracing context's mesh when it has a tp axis > 1 that divides
    the query and cache heads; otherwise as is.

    The CPU attention kernel reads its head counts from its buffers, so under
    shard_map it computes exactly its shard's heads; under plain GSPMD the
    custom call is given the whole (gathered) operands and runs whole on every
    device, which is what a replicated model (an Eagle head whose kv heads do
    not divide) needs.
    """
    mesh = _tp_mesh()
    if mesh is None:
        return call
    size = mesh.shape[TP_AXIS]
    heads = PartitionSpec(None, TP_AXIS, None)  # [T, heads, head_dim]
    cache = PartitionSpec(None, None, TP_AXIS, None)
    replicated = (PartitionSpec(),) * num_replicated
    sharded = jax.shard_map(call, mesh=mesh,
                            in_specs=(heads, heads, heads, PartitionSpec(), cache, cache,
                                      *replicated),
                            out_specs=(heads, cache, cache), check_vma=False)

    def run(*args: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q, k_cache = args[0], args[4]
        if q.shape[1] % size or k_cache.shape[2] % size:
            return call(*args)
        return sharded(*args)

    return run


class Split(enum.Enum):
    """How a projection's weight is split over the tp axis."""

    NONE = "none"  # whole on every device
    COLUMN = "column"  # output columns: each device computes its slice of y
    ROW = "row"  # input rows: each device a partial y, summed over the axis


MatmulCall = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def over_local_panels(call: MatmulCall, split: Split) -> MatmulCall | None:
    """`call(x, panels, num_rows)` (the packed-matmul kernel) run per shard under
    the context mesh, or None without one (the caller runs the whole weight).

    COLUMN: x whole, the panels split by panel (each shard packed its own
    columns), y split by columns. ROW: x and the panels split by input row,
    the partial products summed with psum inside the shard_map.
    """
    mesh = _tp_mesh()
    if mesh is None or split is Split.NONE:
        return None
    whole = PartitionSpec()
    if split is Split.COLUMN:
        return jax.shard_map(call, mesh=mesh,
                             in_specs=(whole, PartitionSpec(TP_AXIS, None, None), whole),
                             out_specs=PartitionSpec(None, TP_AXIS), check_vma=False)

    def summed(x: jax.Array, panels: jax.Array, rows: jax.Array) -> jax.Array:
        # The partials come back in float32 where the kernel can keep them so
        # (bfloat16 x): added there, rounded once, as one device rounds.
        return jax.lax.psum(call(x, panels, rows), TP_AXIS).astype(x.dtype)

    return jax.shard_map(summed, mesh=mesh,
                         in_specs=(PartitionSpec(None, TP_AXIS),
                                   PartitionSpec(None, TP_AXIS, None), whole),
                         out_specs=whole, check_vma=False)
