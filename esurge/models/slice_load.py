"""Loading onto a tensor-parallel mesh: each device reads only its slice.

Every serving parameter is made with `jax.make_array_from_callback`: for
each device it is asked for, the callback reads from the checkpoint just the
rows or columns that device's shard is built from (safetensors `get_slice`)
and lays them out as the serving layout has them (esurge.models.
tensor_parallel): q/k/v and gate/up blocks of the shard fused ([q_i | k_i |
v_i], [gate_i | up_i]), kv heads repeated where there are fewer than
shards, vocabulary rows padded, and, where the CPU kernels serve, packed
into panels. A host of a multi-host job is asked only for its own devices,
so it reads only their slices; host memory holds one slice at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from esurge.models.checkpoint import CheckpointSource
from esurge.models.decoder import CausalLM
from esurge.models.decoder_config import DecoderConfig
from esurge.models.forward import ModelState, Params
from esurge.models.fusion import packed_config, state_for
from esurge.models.packed_linear import pack_gate_up, pack_weight
from esurge.models.tensor_parallel import param_spec, replicated_kv_config, tp_degree

__all__ = ["load_onto_mesh"]

Index = tuple[slice, ...]
Block = Callable[[int], np.ndarray]  # shard -> the [in, out] (or row) block it is built from


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The checkpoint's layout and the serving layout it is read into."""

    source: CheckpointSource
    dtype: jnp.dtype
    config: DecoderConfig  # the checkpoint's
    final: DecoderConfig  # the serving config (tensor_parallel = shards)

    @property
    def shards(self) -> int:
        return self.final.tensor_parallel

    def read(self, name: str, index: Index = ()) -> np.ndarray:
        return np.asarray(self.source.read_slice(name, index)).astype(self.dtype)

    def head_rows(self, name: str, shard: int, kind: str) -> np.ndarray:
        """Rows of a [heads * head_dim, ...] projection (or its bias) for one shard."""
        c, d = self.config, self.config.head_dim
        heads = c.num_heads if kind == "q" else c.num_kv_heads
        if kind == "q" or heads >= self.shards:
            rows = heads * d // self.shards
            return self.read(name, (slice(shard * rows, (shard + 1) * rows),))
        head = shard // (self.shards // heads)  # a kv head repeated over several shards
        return self.read(name, (slice(head * d, (head + 1) * d),))

    def mlp_rows(self, name: str, shard: int) -> np.ndarray:
        rows = self.config.intermediate_size // self.shards
        return self.read(name, (slice(shard * rows, (shard + 1) * rows),))

    def vocab_rows(self, name: str, shard: int) -> np.ndarray:
        """A shard's vocabulary rows, zero rows past the real vocabulary."""
        rows = self.final.padded_vocab_size // self.shards
        start, stop = shard * rows, min((shard + 1) * rows, self.config.vocab_size)
        real = self.read(name, (slice(start, stop),)) if stop > start else None
        if real is not None and real.shape[0] == rows:
            return real
        width = self.config.hidden_size
        out = np.zeros((rows, width), self.dtype)
        if real is not None:
            out[:real.shape[0]] = real
        return out


def _fused_block(layout: _Layout, prefix: str, module: str, leaf: str) -> Block:
    """shard -> its block of a fused projection: [in, out_local] (a bias: [out_local])."""
    def block(s: int) -> np.ndarray:
        if module == "qkv_proj":
            parts = [layout.head_rows(f"{prefix}.self_attn.{p}_proj.{leaf}", s, p)
                     for p in ("q", "k", "v")]
        else:
            parts = [layout.mlp_rows(f"{prefix}.mlp.{p}_proj.{leaf}", s) for p in ("gate", "up")]
        rows = np.concatenate(parts, axis=0)  # [out_local] or [out_local, in]
        return rows if leaf == "bias" else rows.T

    return block


def _packer(layout: _Layout, module: str) -> Callable[[np.ndarray], np.ndarray]:
    """[in, out] block -> its panels."""
    if module == "gate_up_proj" and layout.final.fused_gate_activation:
        local = layout.config.intermediate_size // layout.shards
        return lambda block: np.asarray(pack_gate_up(jnp.asarray(block), local))
    return lambda block: np.asarray(pack_weight(jnp.asarray(block)))


def _source_block(layout: _Layout, path: tuple[str, ...]) -> tuple[Block, bool] | None:
    """(shard -> the checkpoint block this parameter's shard is built from, whether
    that block is output-major [out, in]); None for a replicated parameter."""
    module, leaf = path[-2], path[-1]
    base = ".".join(path[:-1])
    if module in ("embed_tokens", "lm_head"):
        return (lambda s: layout.vocab_rows(f"{base}.weight", s)), True
    if module in ("qkv_proj", "gate_up_proj"):  # a layer's, model.layers.N
        part = "bias" if leaf == "bias" else "weight"
        return _fused_block(layout, ".".join(path[:3]), module, part), False
    if module in ("o_proj", "down_proj") and leaf != "bias":
        width = (layout.config.num_heads * layout.config.head_dim if module == "o_proj"
                 else layout.config.intermediate_size)
        local = width // layout.shards
        return (lambda s: layout.read(f"{base}.weight",
                                      (slice(None), slice(s * local, (s + 1) * local)))), True
    part = "bias" if leaf == "bias" else "weight"
    if module in ("q_proj", "k_proj", "v_proj"):  # unfused: the block is the shard
        return (lambda s: layout.head_rows(f"{base}.{part}", s, module[0])), True
    if module in ("gate_proj", "up_proj"):
        return (lambda s: layout.mlp_rows(f"{base}.{part}", s)), True
    return None


def _reader(layout: _Layout, path: tuple[str, ...], ndim: int) -> Block | None:
    """shard -> this parameter's shard (None: replicated, read whole).

    A weight in the checkpoint's orientation and a bias are the block itself;
    a dual layout's plain weight is the block input-major; a packed weight
    (3-D) is the input-major block packed into panels."""
    found = _source_block(layout, path)
    if found is None:
        return None
    block, output_major = found
    leaf = path[-1]
    if leaf == "bias" or (leaf == "weight" and ndim == 2):
        return block
    input_major: Block = (lambda s: block(s).T) if output_major else block
    if leaf == "plain":
        return input_major
    pack = _packer(layout, path[-2])
    return lambda s: pack(input_major(s))


def _shard_of(index: Index, spec: Any, shape: tuple[int, ...], shards: int) -> int:
    axis = next(i for i, part in enumerate(spec) if part is not None)
    return (index[axis].start or 0) // (shape[axis] // shards)


def _check_shapes(abstract: Params, source: CheckpointSource) -> None:
    """Every tensor of the checkpoint's layout present with its shape (read from
    the file headers), before any slice is read."""
    def check(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> None:
        name = ".".join(str(getattr(key, "key", key)) for key in path)
        shape = source.tensor_shape(name)
        if shape != tuple(leaf.shape):
            raise ValueError(f"tensor {name!r} has shape {shape}, expected {tuple(leaf.shape)}")

    jax.tree_util.tree_map_with_path(check, abstract)


def load_onto_mesh(abstract: Params, source: CheckpointSource, config: DecoderConfig,
                   dtype: jnp.dtype, mesh: Mesh, fuse: bool, pack: bool = False,
                   dual: bool = False) -> tuple[DecoderConfig, ModelState]:
    """(serving config, placed model), each device's shards read from the checkpoint.

    abstract: the parameter shapes of `config` (the checkpoint's own layout),
    checked against the file before anything is read. fuse / pack / dual: the
    serving layout (esurge.models.fusion).
    """
    _check_shapes(abstract, source)
    final = dataclasses.replace(replicated_kv_config(config, tp_degree(mesh)),
                                fused_projections=fuse)
    if pack:
        final = packed_config(final, dual)
    layout = _Layout(source, jnp.dtype(dtype), config, final)
    shapes = nnx.to_pure_dict(nnx.split(nnx.eval_shape(lambda: CausalLM(final, dtype=dtype)))[1])
    host = jax.local_devices(backend="cpu")[0]

    def make(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.Array:
        names = tuple(str(getattr(key, "key", key)) for key in path)
        spec = param_spec(names, len(leaf.shape))
        read = _reader(layout, names, len(leaf.shape))
        shape = tuple(leaf.shape)

        def shard(index: Index | None) -> np.ndarray:
            index = index or ()
            if read is None or all(part is None for part in spec):
                return layout.read(".".join(names))[index]
            return read(_shard_of(index, spec, shape, layout.shards))

        return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), shard)

    with jax.default_device(host):  # packing runs in host memory
        params = jax.tree_util.tree_map_with_path(make, shapes)
    return final, state_for(final, params, dtype)
