"""Flax (nnx) decoder models over a paged KV cache, loaded from HF safetensors checkpoints.

Typical use by the runner:

    loaded = load_model(path, dtype="bfloat16")
    groups = loaded.cache_groups(num_pages, page_size)
    kv = init_kv_cache(groups)
    batch = build_forward_batch(chunks, page_size=..., num_groups=len(groups.groups), ...)
    logits, hidden, kv = jit_forward(loaded.model_state, kv, batch)
"""

from esurge.models.batch import ForwardBatch, RequestChunk, build_forward_batch
from esurge.models.decoder import CausalLM
from esurge.models.decoder_config import (
    Activation,
    AttentionKind,
    DecoderConfig,
    LayerAttention,
    RopeConfig,
    RopeType,
)
from esurge.models.forward import ModelState, forward, jit_forward
from esurge.models.kv_cache import NULL_PAGE, KVCache, init_kv_cache
from esurge.models.loader import LoadedModel, load_model
from esurge.models.paged_attention import AttentionMetadata, paged_attention, write_kv
from esurge.models.registry import SUPPORTED_ARCHITECTURES, policy_for

__all__ = [
    "NULL_PAGE",
    "SUPPORTED_ARCHITECTURES",
    "Activation",
    "AttentionKind",
    "AttentionMetadata",
    "CausalLM",
    "DecoderConfig",
    "ForwardBatch",
    "KVCache",
    "LayerAttention",
    "LoadedModel",
    "ModelState",
    "RequestChunk",
    "RopeConfig",
    "RopeType",
    "build_forward_batch",
    "forward",
    "init_kv_cache",
    "jit_forward",
    "load_model",
    "paged_attention",
    "policy_for",
    "write_kv",
]
