"""Tensor parallelism: the mesh, the per-shard layout and the sharding rules.

The seam between the model code and the devices. The model code is written
once, for the whole model (GSPMD partitions it); what tensor parallelism
changes is decided here, at load time:

- the mesh: one `tp` axis over the first `tensor_parallel_size` devices,
  with Auto axis types so the model code runs unchanged under it;
- the layout (`replicated_kv_config`; each device's shard of it is read by
  esurge.models.slice_load): kv heads replicated up to the TP degree when
  there are fewer, the vocabulary padded to a
  multiple of it, and fused projections laid out per shard ([q_i | k_i |
  v_i], [gate_i | up_i]) so a shard's columns of a fused weight are exactly
  its own heads' (the model splits a fused output per shard,
  `DecoderConfig.tensor_parallel`);
- the mesh of a multi-host job takes the same number of devices from each
  host (`make_mesh`);
- the rules (`param_spec`): one function from a parameter's path to its
  PartitionSpec. q/k/v and gate/up are column-parallel, o and down
  row-parallel (their partial sums meet in one all-reduce each), embedding
  and LM head vocab-parallel, norms replicated;
- the KV cache: every slot sharded by kv head (`kv_cache_sharding`);
- kernels that must see only their shard (esurge.models.local_shards): the
  CPU attention kernel runs under `shard_map` on the local heads and cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from esurge.errors import InvalidConfigError
from esurge.models.decoder_config import DecoderConfig
from esurge.models.local_shards import TP_AXIS

__all__ = [
    "TP_AXIS", "check_divisible", "kv_cache_sharding", "make_mesh", "param_spec",
    "replicated", "replicated_kv_config", "tp_degree",
]

FIELD = "tensor_parallel_size"

# Module names by how their weight splits (the serving layout's and the
# checkpoint's names both: an unfused model shards too).
_COLUMN_INPUT_MAJOR = frozenset({"qkv_proj", "gate_up_proj"})  # [in, out]
_COLUMN_OUTPUT_MAJOR = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
_ROW = frozenset({"o_proj", "down_proj"})  # [out, in]: split the input
_VOCAB = frozenset({"embed_tokens", "lm_head"})  # [vocab, hidden]


def make_mesh(size: int) -> Mesh:
    """A one-axis (`tp`) mesh, Auto axis types: the first `size` devices, or in a
    multi-host job the first size / hosts devices of every host, host by host."""
    hosts = jax.process_count()
    share = size // hosts
    local = {p: [d for d in jax.devices() if d.process_index == p] for p in range(hosts)}
    fewest = min(len(devices) for devices in local.values())
    if size % hosts or share > fewest:
        have = fewest * hosts if hosts > 1 else fewest
        raise InvalidConfigError(FIELD, f"{FIELD}={size} needs {size} devices, but only "
                                        f"{have} {jax.default_backend()} device(s) exist"
                                        + (f" ({fewest} on each of {hosts} hosts)"
                                           if hosts > 1 else ""))
    devices = [d for p in range(hosts) for d in local[p][:share]]
    return Mesh(np.array(devices), (TP_AXIS,), axis_types=(AxisType.Auto,))


def _host_copy(array: Any) -> Any:
    """A host copy to place from: in a multi-host job an array on this host's
    device cannot be the source of a global one."""
    return np.asarray(array) if jax.process_count() > 1 else array


def tp_degree(mesh: Mesh | None) -> int:
    """Devices on the mesh's tp axis (1 without a mesh)."""
    return 1 if mesh is None else int(mesh.shape[TP_AXIS])


def check_divisible(config: DecoderConfig, size: int) -> None:
    """InvalidConfigError (field tensor_parallel_size) when the model cannot split size ways."""
    heads, kv = config.num_heads, config.num_kv_heads
    problems = []
    if heads % size:
        problems.append(f"{heads} attention heads")
    if kv % size and size % kv:
        problems.append(f"{kv} kv heads (neither a multiple of it nor replicable up to it)")
    if config.intermediate_size % size:
        problems.append(f"an MLP of {config.intermediate_size} columns")
    if problems:
        raise InvalidConfigError(FIELD, f"{FIELD}={size} does not divide the model: "
                                        + ", ".join(problems))


def replicated_kv_config(config: DecoderConfig, size: int) -> DecoderConfig:
    """The config laid out for size shards: kv heads repeated up to size when
    fewer, tensor_parallel set (InvalidConfigError when the heads do not divide)."""
    check_divisible(config, size)
    return dataclasses.replace(config, num_kv_heads=max(config.num_kv_heads, size),
                               tensor_parallel=size)


def param_spec(path: tuple[str, ...], ndim: int) -> PartitionSpec:
    """The PartitionSpec of the parameter at path (module names, then the leaf:
    weight, bias, or the plain weight a dual-layout packed module keeps).

    A packed weight ([panels, in, PANEL]) of a column-parallel projection was
    packed per shard and splits by panel; a row-parallel one splits by input
    row. A plain (input-major, [in, out]) weight splits like its projection.
    """
    module, leaf = (path[-2], path[-1]) if len(path) >= 2 else ("", path[-1])
    column = module in _COLUMN_INPUT_MAJOR or module == "lm_head"
    if module in _VOCAB and ndim == 2 and leaf == "weight":
        return PartitionSpec(TP_AXIS, None)  # [vocab, hidden]
    if column or module in _COLUMN_OUTPUT_MAJOR:
        if leaf == "bias":
            return PartitionSpec(TP_AXIS)
        if ndim == 3:
            return PartitionSpec(TP_AXIS, None, None)
        input_major = leaf == "plain" or module in _COLUMN_INPUT_MAJOR
        return PartitionSpec(None, TP_AXIS) if input_major else PartitionSpec(TP_AXIS, None)
    if module in _ROW and leaf != "bias":
        if ndim == 3:
            return PartitionSpec(None, TP_AXIS, None)
        return PartitionSpec(TP_AXIS, None) if leaf == "plain" else PartitionSpec(None, TP_AXIS)
    return PartitionSpec(*([None] * ndim))


def kv_cache_sharding(mesh: Mesh, num_kv_heads: int | None = None) -> NamedSharding:
    """Every cache slot [pages, page_size, kv_heads, head_dim] split by kv head;
    replicated when num_kv_heads is given and the mesh does not divide it (an
    Eagle head's cache, whose attention then runs whole on every device)."""
    if num_kv_heads is not None and num_kv_heads % tp_degree(mesh):
        return NamedSharding(mesh, PartitionSpec())
    # Spelled as the compiled step returns it (no trailing None), so the
    # cache a step hands back is the very sharding the next step was built for.
    return NamedSharding(mesh, PartitionSpec(None, None, TP_AXIS))


def replicated(tree: Any, mesh: Mesh | None) -> Any:
    """A pytree of arrays copied whole to every device of the mesh (as is without one)."""
    if mesh is None:
        return tree
    return jax.device_put(jax.tree.map(_host_copy, tree), NamedSharding(mesh, PartitionSpec()))
