"""Loading a checkpoint straight onto a tensor-parallel mesh, one layer at a time.

A model split over devices is one that may not fit any one of them, so no
parameter is ever assembled whole on a device: each layer's tensors are read
into host memory (JAX's CPU device), laid out for the shards there (kv heads
replicated, projections fused per shard, vocabulary padded;
esurge.models.tensor_parallel) and placed, every device receiving its slice;
then the host copy is dropped. Host memory stays at about one layer (or the
embedding, when larger), device memory at each device's share.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from esurge.models.checkpoint import CheckpointSource
from esurge.models.decoder_config import DecoderConfig
from esurge.models.forward import ModelState, Params
from esurge.models.fusion import fuse_layer, pack_layer, pack_lm_head, packed_config, state_for
from esurge.models.tensor_parallel import (
    pad_vocab,
    place_tree,
    replicate_layer_kv,
    replicated_kv_config,
    tp_degree,
)

__all__ = ["load_onto_mesh", "read_tree"]


def read_tree(abstract: Any, source: CheckpointSource, dtype: jnp.dtype,
              prefix: tuple[str, ...] = ()) -> Any:
    """The checkpoint tensors of an abstract parameter subtree (at path prefix),
    shape-checked and cast to dtype, on the default device."""
    def load(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.Array:
        name = ".".join(prefix + tuple(str(getattr(key, "key", key)) for key in path))
        array = source.read(name)
        if tuple(array.shape) != tuple(leaf.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(array.shape)}, expected "
                             f"{tuple(leaf.shape)}")
        return jnp.asarray(array, dtype=dtype)

    return jax.tree_util.tree_map_with_path(load, abstract)


def _vocab_tables(abstract: Params, source: CheckpointSource, laid: DecoderConfig,
                  dtype: jnp.dtype) -> Params:
    tables: Params = {"model": {"embed_tokens": read_tree(
        abstract["model"]["embed_tokens"], source, dtype, ("model", "embed_tokens"))}}
    if abstract.get("lm_head") is not None:
        tables["lm_head"] = read_tree(abstract["lm_head"], source, dtype, ("lm_head",))
    return pad_vocab(laid, tables)


def load_onto_mesh(abstract: Params, source: CheckpointSource, config: DecoderConfig,
                   dtype: jnp.dtype, mesh: Mesh, fuse: bool, pack: bool = False,
                   dual: bool = False) -> tuple[DecoderConfig, ModelState]:
    """(serving config, placed model) from the checkpoint's tensors.

    abstract: the parameter shapes of `config` (the checkpoint's own layout).
    fuse: bring the projections into the fused serving layout; pack: then into
    column panels per shard (esurge.models.fusion.pack_layer; dual keeps the
    plain weights too).
    """
    size = tp_degree(mesh)
    laid = replicated_kv_config(config, size)
    final = dataclasses.replace(laid, fused_projections=fuse)
    if pack:
        final = packed_config(final, dual)

    def serving(shapes: Params, where: tuple[str, ...]) -> Params:
        # Each step rebinds `layer`, so the previous form can be freed at once.
        layer = replicate_layer_kv(read_tree(shapes, source, dtype, where),
                                   config.num_kv_heads, size)
        if fuse:
            layer = fuse_layer(layer, size)
        if pack:
            layer = pack_layer(final, layer)
        return layer

    host = jax.local_devices(backend="cpu")[0]
    with jax.default_device(host):
        tables = _vocab_tables(abstract, source, laid, dtype)
        if pack and tables.get("lm_head") is not None:
            tables["lm_head"] = pack_lm_head(final, tables["lm_head"])
        params = place_tree(tables, mesh)
        model = params["model"]
        model["norm"] = place_tree(read_tree(abstract["model"]["norm"], source, dtype,
                                             ("model", "norm")), mesh, ("model", "norm"))
        model["layers"] = {}
        for i, shapes in abstract["model"]["layers"].items():
            where = ("model", "layers", str(i))
            model["layers"][i] = place_tree(serving(shapes, where), mesh, where)
    if "lm_head" in abstract and abstract["lm_head"] is None:
        params["lm_head"] = None
    return final, state_for(final, params, dtype)
