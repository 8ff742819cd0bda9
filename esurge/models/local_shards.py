"""Kernels that must run on their own shard, under the tracing context's mesh.

GSPMD partitions the model's JAX code by itself, but a custom call is opaque
to it: given sharded operands, it gathers them and runs the call whole on
every device. A kernel that is naturally per head (attention) is instead
wrapped in `shard_map` here, when the mesh the runner traces under
(`jax.set_mesh`) splits heads; without such a mesh it runs as is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
from jax.sharding import PartitionSpec

__all__ = ["TP_AXIS", "host_visible", "over_local_heads"]

TP_AXIS = "tp"

AttentionCall = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
Tree = TypeVar("Tree")


def _tp_mesh() -> jax.sharding.AbstractMesh | None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TP_AXIS not in mesh.axis_names or mesh.shape[TP_AXIS] == 1:
        return None
    return mesh


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
