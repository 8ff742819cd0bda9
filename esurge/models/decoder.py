"""The one decoder-only causal LM that every supported family runs on.

`CausalLM` mirrors the HF module tree (`model.embed_tokens`, `model.layers.N`,
`model.norm`, `lm_head`) so checkpoint keys are module paths. Its forward
runs the flattened batch through every layer, each layer reading and writing
its own slot of the paged cache through its group's page table.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from esurge.core.kv_cache_spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    SlidingWindowSpec,
)
from esurge.models.batch import ForwardBatch
from esurge.models.coded_linear import CodedLinear, coded_or_plain
from esurge.models.decoder_config import AttentionKind, DecoderConfig, LayerAttention, RopeConfig
from esurge.models.kv_cache import KVCache
from esurge.models.layers import (
    AnyLinear,
    DecoderLayer,
    Embedding,
    embedding_scale,
    make_norm,
    serving_linear,
)
from esurge.models.local_shards import Split
from esurge.models.paged_attention import AttentionMetadata
from esurge.models.rope import rope_cos_sin

__all__ = ["CausalLM", "DecoderModel", "LayerCall"]


def _spec_matches(layer: LayerAttention, spec: AttentionSpec) -> bool:
    if isinstance(spec, SlidingWindowSpec):
        return layer.kind is AttentionKind.SLIDING and layer.window == spec.sliding_window
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return layer.kind is AttentionKind.CHUNKED and layer.window == spec.attention_chunk_size
    return layer.kind is AttentionKind.FULL


def check_cache_layout(config: DecoderConfig, kv_cache: KVCache, batch: ForwardBatch) -> None:
    """ValueError when the cache or batch was built for another model or grouping."""
    if len(kv_cache.layer_slots) != config.num_layers:
        raise ValueError(
            f"kv cache covers {len(kv_cache.layer_slots)} layers, the model has {config.num_layers}"
        )
    for i, (layer, spec) in enumerate(zip(config.layers, kv_cache.layer_specs, strict=True)):
        if not _spec_matches(layer, spec):
            raise ValueError(f"layer {i} is {layer.kind.value} (window {layer.window}) but its "
                             f"cache group spec is {spec!r}")
        if (spec.num_kv_heads, spec.head_dim) != (config.num_kv_heads, config.head_dim):
            raise ValueError(
                f"layer {i} cache holds {spec.num_kv_heads} kv heads of {spec.head_dim}, the model "
                f"has {config.num_kv_heads} of {config.head_dim}"
            )
    groups = kv_cache.num_groups
    if batch.slot_mapping.shape[0] != groups or batch.page_tables.shape[0] != groups:
        raise ValueError(
            f"batch has slot_mapping for {batch.slot_mapping.shape[0]} and page_tables for "
            f"{batch.page_tables.shape[0]} cache groups, the cache has {groups}"
        )


class LayerCall(Protocol):
    """How the forward runs decoder layer `index` (traced inline, or through a shared trace)."""

    def __call__(self, index: int,
                 x: jax.Array,  # [T, hidden]
                 rope: tuple[jax.Array, jax.Array],
                 kv: tuple[jax.Array, jax.Array],
                 metadata: AttentionMetadata,
                 slot_mapping: jax.Array,  # [T]
                 block_pages: int | None,
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]: ...


class DecoderModel(nnx.Module):
    """Embedding, decoder layers and final norm (the HF `model.` subtree)."""

    def __init__(self, config: DecoderConfig, *, dtype: jnp.dtype):
        self.embed_tokens = Embedding(config.padded_vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nnx.List(
            [DecoderLayer(config, layer, dtype=dtype) for layer in config.layers])
        self.norm = make_norm(config.hidden_size, config, dtype)


class CausalLM(nnx.Module):
    """A decoder-only causal LM over a paged KV cache."""

    def __init__(self, config: DecoderConfig, *, dtype: jnp.dtype):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.model = DecoderModel(config, dtype=dtype)
        # A coded head gets its panels even when tied to the embedding: the
        # kernel streams them at decode, and large buckets (dual layout)
        # multiply by the float32 embedding instead.
        head_bits = config.code_bits("lm_head")
        if head_bits is not None:
            self.lm_head: AnyLinear | None = CodedLinear(
                config.hidden_size, config.padded_vocab_size, bits=head_bits, bias=False,
                dtype=dtype, dual=config.dual_layout and not config.tie_word_embeddings)
        elif config.tie_word_embeddings and not config.packed_tied_head:
            self.lm_head = None
        else:
            self.lm_head = serving_linear(config, config.hidden_size, config.padded_vocab_size,
                                          bias=False, dtype=dtype, split=Split.COLUMN,
                                          role="lm_head")

    def __call__(
        self,
        batch: ForwardBatch,
        kv_cache: KVCache,
        aux_hidden_layer_ids: tuple[int, ...],
        block_pages: int | None,
        call_layer: LayerCall | None = None,
    ) -> tuple[jax.Array, jax.Array | None, KVCache]:
        """(final normed hidden [T, H], outputs of the aux layers [A, T, H] or None, new cache).

        call_layer runs layer i (default: this module's layer, traced in place)."""
        call_layer = self._inline_layer if call_layer is None else call_layer
        config = self.config
        check_cache_layout(config, kv_cache, batch)
        positions, token_req = jnp.asarray(batch.positions), jnp.asarray(batch.token_req)
        x = self.model.embed_tokens(jnp.asarray(batch.input_ids))
        scale = embedding_scale(config, self.dtype)
        if scale is not None:
            x = x * scale
        token_seq_lens = jnp.asarray(batch.seq_lens)[token_req]
        tables: dict[RopeConfig, tuple[jax.Array, jax.Array]] = {}
        page_tables, num_tokens = jnp.asarray(batch.page_tables), jnp.asarray(batch.num_tokens)
        slot_mapping = jnp.asarray(batch.slot_mapping)
        tile_rows = None if batch.tile_rows is None else jnp.asarray(batch.tile_rows)
        row_in_tiles = None if batch.row_in_tiles is None else jnp.asarray(batch.row_in_tiles)
        metadata = [AttentionMetadata(positions, token_req, page_tables[g], num_tokens,
                                      query_tile=batch.query_tile, tile_rows=tile_rows,
                                      row_in_tiles=row_in_tiles)
                    for g in range(kv_cache.num_groups)]
        aux: dict[int, jax.Array] = {}
        for i in range(config.num_layers):
            rope = config.layers[i].rope
            if rope not in tables:
                tables[rope] = rope_cos_sin(rope, config.head_dim, positions, token_seq_lens)
            group, slot = kv_cache.layer_slots[i]
            x, (k, v) = call_layer(i, x, tables[rope],
                                   (kv_cache.keys[slot], kv_cache.values[slot]),
                                   metadata[group], slot_mapping[group], block_pages)
            kv_cache = kv_cache.replace_slot(slot, k, v)
            if i in aux_hidden_layer_ids:
                aux[i] = x
        hidden = self.model.norm(x)
        stacked = jnp.stack([aux[i] for i in aux_hidden_layer_ids]) if aux else None
        return hidden, stacked, kv_cache

    def _inline_layer(self, index: int, x: jax.Array,  # [T, hidden]
                      rope: tuple[jax.Array, jax.Array], kv: tuple[jax.Array, jax.Array],
                      metadata: AttentionMetadata, slot_mapping: jax.Array,  # [T]
                      block_pages: int | None
                      ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        return self.model.layers[index](x, rope, kv, metadata, slot_mapping, block_pages)

    def compute_logits(self, hidden: jax.Array,  # [L, H] -> [L, vocab] float32
                       num_rows: jax.Array | None = None,  # [] int32: rows past it are padding
                       ) -> jax.Array:
        """LM head (tied to the embedding when configured) and final soft-capping.

        Rows at or past num_rows are padding: a packed or coded head skips
        them (their logits come back zero)."""
        config, head = self.config, self.lm_head
        embedding = self.model.embed_tokens.weight

        # The logits stay float32 sums whatever the model's dtype: rounded to
        # bfloat16 (8 significant bits) they tie near-ties outright (SmolLM2's
        # first answer token to "What is the capital of France?": 0.08 apart in
        # float32, equal in bfloat16, and the lower id won with a reply in French).
        def tied() -> jax.Array:
            return jnp.einsum("lh,vh->lv", hidden, embedding[...],
                              preferred_element_type=jnp.float32)

        if head is None:
            logits = tied()
        elif config.tie_word_embeddings and config.dual_layout:  # a coded head, tied
            logits = coded_or_plain(hidden, lambda: head(hidden, num_rows, float32_out=True),
                                    tied)
        else:
            logits = head(hidden, num_rows, float32_out=True)
        if logits.shape[-1] != self.config.vocab_size:  # rows padded for the shards
            logits = logits[:, :self.config.vocab_size]
        cap = self.config.final_softcap
        if cap is not None:
            logits = jnp.tanh(logits / cap) * cap
        return logits.astype(jnp.float32)
