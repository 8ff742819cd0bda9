"""Per-family policies and the translation of a Hugging Face config into a DecoderConfig.

All supported families share one decoder; a `FamilyPolicy` records only what
differs between them and which HF config fields carry it. Attention kinds and
windows per layer come from `esurge.core.kv_cache_spec`, the same source the
KV cache manager groups layers by, so the model and its cache always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from esurge.core.kv_cache_spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    SlidingWindowSpec,
    layer_specs_from_hf_config,
)
from esurge.models.decoder_config import (
    Activation,
    AttentionKind,
    DecoderConfig,
    LayerAttention,
    RopeConfig,
    RopeType,
)

__all__ = [
    "GEMMA2",
    "GEMMA3",
    "LLAMA",
    "MISTRAL",
    "QWEN2",
    "QWEN3",
    "BiasRule",
    "FamilyPolicy",
    "decoder_config_from_hf",
    "rope_config_from_hf",
]


class BiasRule(StrEnum):
    """Which attention projections carry a bias."""

    NONE = "none"  # Mistral: never, whatever the config says
    QKV = "qkv"  # Qwen2: q, k and v always, o never
    CONFIG = "config"  # `attention_bias` switches q, k, v and o together


@dataclass(frozen=True, slots=True)
class FamilyPolicy:
    """What one model family does differently from plain Llama."""

    name: str
    bias_rule: BiasRule = BiasRule.CONFIG
    mlp_bias_from_config: bool = False
    qk_norm: bool = False
    norm_offset: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: bool = False
    attn_softcap: bool = False
    final_softcap: bool = False
    activation_field: str = "hidden_act"


LLAMA = FamilyPolicy(name="llama", mlp_bias_from_config=True)
MISTRAL = FamilyPolicy(name="mistral", bias_rule=BiasRule.NONE)
QWEN2 = FamilyPolicy(name="qwen2", bias_rule=BiasRule.QKV)
QWEN3 = FamilyPolicy(name="qwen3", qk_norm=True)
GEMMA2 = FamilyPolicy(
    name="gemma2",
    norm_offset=True,
    sandwich_norms=True,
    scale_embeddings=True,
    query_pre_attn_scalar=True,
    attn_softcap=True,
    final_softcap=True,
    activation_field="hidden_activation",
)
# transformers' Gemma 3 never passes attn_logit_softcapping to its attention, so neither do we.
GEMMA3 = replace(GEMMA2, name="gemma3", qk_norm=True, attn_softcap=False)


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, None)
    return default if value is None else value


def _rope_parameters(text: Any, kind: AttentionKind) -> tuple[dict[str, Any], bool]:
    """The raw RoPE dict for a layer kind, and whether it came from a per-kind entry."""
    params = getattr(text, "rope_parameters", None)
    if isinstance(params, dict) and params:
        nested = params.get(kind.value)
        if isinstance(nested, dict):
            return dict(nested), True
        if "rope_type" in params or "type" in params or "rope_theta" in params:
            return dict(params), False
        raise ValueError(f"rope_parameters has no entry for layer type {kind.value!r}: {params!r}")
    # transformers < 5 keeps rope_theta / rope_scaling (and Gemma 3's rope_local_base_freq) apart.
    local_theta = getattr(text, "rope_local_base_freq", None)
    if kind is AttentionKind.SLIDING and local_theta is not None:
        return {"rope_type": "default", "rope_theta": local_theta}, True
    legacy = dict(getattr(text, "rope_scaling", None) or {})
    legacy.setdefault("rope_theta", _get(text, "rope_theta", 10000.0))
    return legacy, False


def rope_config_from_hf(text: Any, kind: AttentionKind) -> RopeConfig:
    """The RoPE of layers of `kind`, read from a HF text config."""
    params, _ = _rope_parameters(text, kind)
    name = params.get("rope_type", params.get("type", "default"))
    supported = ", ".join(t.value for t in RopeType)
    if name not in {t.value for t in RopeType}:
        raise ValueError(f"unsupported rope_type {name!r}; supported: {supported}")
    partial = params.get("partial_rotary_factor", _get(text, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial!r} is not supported (only 1.0)")
    rope_type = RopeType(name)
    max_pos = _get(text, "max_position_embeddings")
    return RopeConfig(
        rope_type=rope_type,
        theta=float(params.get("rope_theta", _get(text, "rope_theta", 10000.0))),
        factor=float(params.get("factor", 1.0)) if rope_type is not RopeType.DEFAULT else 1.0,
        low_freq_factor=params.get("low_freq_factor"),
        high_freq_factor=params.get("high_freq_factor"),
        original_max_position_embeddings=params.get("original_max_position_embeddings", max_pos)
        if rope_type is RopeType.LLAMA3 else None,
        max_position_embeddings=int(max_pos) if rope_type is RopeType.DYNAMIC else None,
    )


def _layer_attention(spec: AttentionSpec, text: Any) -> LayerAttention:
    if isinstance(spec, SlidingWindowSpec):
        kind, window = AttentionKind.SLIDING, spec.sliding_window
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        kind, window = AttentionKind.CHUNKED, spec.attention_chunk_size
    else:
        kind, window = AttentionKind.FULL, None
    return LayerAttention(kind=kind, window=window, rope=rope_config_from_hf(text, kind))


def _biases(text: Any, policy: FamilyPolicy) -> tuple[bool, bool]:
    if policy.bias_rule is BiasRule.NONE:
        return False, False
    if policy.bias_rule is BiasRule.QKV:
        return True, False
    flag = bool(_get(text, "attention_bias", False))
    return flag, flag


def _activation(text: Any, policy: FamilyPolicy) -> Activation:
    name = _get(text, policy.activation_field) or _get(text, "hidden_act")
    supported = ", ".join(a.value for a in Activation)
    if name not in {a.value for a in Activation}:
        raise ValueError(f"unsupported {policy.activation_field} {name!r}; supported: {supported}")
    return Activation(name)


def decoder_config_from_hf(hf_config: Any, policy: FamilyPolicy) -> DecoderConfig:
    """Translate a HF causal-LM config of `policy`'s family into a DecoderConfig."""
    text = getattr(hf_config, "text_config", None) or hf_config
    if getattr(text, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported by a causal LM")
    num_heads = int(text.num_attention_heads)
    head_dim = int(_get(text, "head_dim", text.hidden_size // num_heads))
    specs = layer_specs_from_hf_config(text, page_size=1)
    qkv_bias, o_bias = _biases(text, policy)
    query_scale = head_dim ** -0.5
    if policy.query_pre_attn_scalar:
        query_scale = float(_get(text, "query_pre_attn_scalar", head_dim)) ** -0.5
    return DecoderConfig(
        vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size),
        intermediate_size=int(text.intermediate_size),
        num_heads=num_heads,
        num_kv_heads=int(_get(text, "num_key_value_heads", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_get(text, "rms_norm_eps", 1e-6)),
        activation=_activation(text, policy),
        layers=tuple(_layer_attention(spec, text) for spec in specs),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(_get(text, "mlp_bias", False)) and policy.mlp_bias_from_config,
        qk_norm=policy.qk_norm,
        norm_offset=policy.norm_offset,
        sandwich_norms=policy.sandwich_norms,
        scale_embeddings=policy.scale_embeddings,
        query_scale=query_scale,
        attn_softcap=_get(text, "attn_logit_softcapping") if policy.attn_softcap else None,
        final_softcap=_get(text, "final_logit_softcapping") if policy.final_softcap else None,
        tie_word_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
    )
