"""The static description of one decoder-only model, independent of its family.

A `DecoderConfig` is what the shared decoder implementation reads: every
family difference (biases, norm style, soft-capping, per-layer attention kind
and RoPE) is a field here, filled in from a Hugging Face config by the family
policies in `esurge.models.families`. It is frozen and hashable so it can sit
in a jitted function's static data.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "CODED_ROLES",
    "WIDENED_BITS",
    "Activation",
    "AttentionKind",
    "DecoderConfig",
    "LayerAttention",
    "RopeConfig",
    "RopeType",
]


class AttentionKind(StrEnum):
    """How far back a layer's queries may look; values are HF `layer_types` names."""

    FULL = "full_attention"
    SLIDING = "sliding_attention"
    CHUNKED = "chunked_attention"


class Activation(StrEnum):
    """MLP gate activations, named as in HF `hidden_act`."""

    SILU = "silu"
    GELU_TANH = "gelu_pytorch_tanh"
    GELU = "gelu"


class RopeType(StrEnum):
    """RoPE frequency schemes, named as in HF `rope_type`."""

    DEFAULT = "default"
    LINEAR = "linear"
    DYNAMIC = "dynamic"
    LLAMA3 = "llama3"


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _positive_float(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters of one layer type.

    factor: linear / dynamic / llama3 scaling factor (1.0 for default).
    low_freq_factor, high_freq_factor, original_max_position_embeddings: llama3 only.
    max_position_embeddings: the length past which dynamic NTK scaling starts.
    """

    rope_type: RopeType
    theta: float
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rope_type", RopeType(self.rope_type))
        _positive_float("theta", self.theta)
        _positive_float("factor", self.factor)
        if self.rope_type is RopeType.LLAMA3:
            _positive_float("low_freq_factor", self.low_freq_factor)
            _positive_float("high_freq_factor", self.high_freq_factor)
            _positive_int("original_max_position_embeddings", self.original_max_position_embeddings)
            if self.high_freq_factor == self.low_freq_factor:
                raise ValueError(
                    f"high_freq_factor must differ from low_freq_factor, both are "
                    f"{self.low_freq_factor!r}"
                )
        if self.rope_type is RopeType.DYNAMIC:
            _positive_int("max_position_embeddings", self.max_position_embeddings)


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """One layer's attention kind, its window (sliding size or chunk size) and RoPE."""

    kind: AttentionKind
    window: int | None
    rope: RopeConfig

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", AttentionKind(self.kind))
        if self.kind is AttentionKind.FULL:
            if self.window is not None:
                raise ValueError(f"window must be None for full attention, got {self.window!r}")
        else:
            _positive_int("window", self.window)


# The projections a layout may keep as codes: each layer's fused ones and the LM head.
CODED_ROLES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
# The "code width" of panels that keep a bfloat16 checkpoint's own values.
WIDENED_BITS = 16


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Everything the shared decoder needs to know about one checkpoint.

    norm_offset: RMSNorm scales by (1 + weight) computed in float32 (Gemma).
    sandwich_norms: norms after attention and around the MLP (Gemma 2/3);
        otherwise `post_attention_layernorm` is the pre-MLP norm (Llama).
    scale_embeddings: multiply token embeddings by sqrt(hidden_size) (Gemma).
    query_scale: the factor on q.k (head_dim**-0.5, or query_pre_attn_scalar**-0.5).
    fused_projections: the serving layout: q/k/v and gate/up each run as one
        input-major matmul (esurge.models.fusion); checkpoints always load
        unfused, in the Hugging Face layout, and are fused afterwards.
    packed_weights: on top of fusion, every projection and the untied LM head
        store their weight in column panels for the CPU matmul kernel
        (esurge.models.packed_linear); needs fused_projections.
    dual_layout: on top of packing, every packed projection also keeps its
        input-major weight, which large buckets multiply by with XLA (chosen at
        load where the CPU lacks AVX-512; see packed_linear.DUAL_KERNEL_MAX_ROWS).
    tensor_parallel: the shards the layout is cut for (esurge.models.
        tensor_parallel): fused projections hold each shard's columns
        together ([q_i | k_i | v_i]) and the vocabulary rows are padded to a
        multiple of it. 1 is the checkpoint's own layout.
    coded_weights: on top of packing, the projections (by role, see
        CODED_ROLES) whose panels hold a GGUF's integer codes of that many
        bits (4, 8), or the checkpoint's bfloat16 values (16, WIDENED_BITS),
        instead of float32; both are multiplied in float32
        (esurge.models.coded_linear); one device only.
    packed_tied_head: on top of packing, a tied LM head also gets panels of
        its own (a packed copy of the embedding). Chosen at load for bfloat16,
        whose kernel multiplies the head at AMX/AVX512_BF16 rates where XLA's
        CPU bfloat16 matmul crawls; one device, no dual layout.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    activation: Activation
    layers: tuple[LayerAttention, ...]
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_offset: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    tie_word_embeddings: bool = False
    fused_projections: bool = False
    packed_weights: bool = False
    dual_layout: bool = False
    tensor_parallel: int = 1
    coded_weights: tuple[tuple[str, int], ...] = ()
    packed_tied_head: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_heads",
                     "num_kv_heads", "head_dim", "tensor_parallel"):
            _positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        _positive_float("rms_norm_eps", self.rms_norm_eps)
        object.__setattr__(self, "activation", Activation(self.activation))
        layers = tuple(self.layers)
        if not layers:
            raise ValueError("layers must describe at least one decoder layer")
        object.__setattr__(self, "layers", layers)
        if self.query_scale is None:
            object.__setattr__(self, "query_scale", self.head_dim ** -0.5)
        _positive_float("query_scale", self.query_scale)
        for name in ("attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None:
                _positive_float(name, value)
        if self.packed_weights and not self.fused_projections:
            raise ValueError("packed_weights=True needs fused_projections=True")
        if self.dual_layout and not self.packed_weights:
            raise ValueError("dual_layout=True needs packed_weights=True")
        self._check_coded_weights()
        if self.packed_tied_head and not (
                self.packed_weights and self.tie_word_embeddings and not self.dual_layout
                and self.tensor_parallel == 1 and self.code_bits("lm_head") is None):
            raise ValueError("packed_tied_head needs packed weights, tied embeddings, one "
                             "device, no dual layout and no coded LM head")

    def _check_coded_weights(self) -> None:
        object.__setattr__(self, "coded_weights", tuple(map(tuple, self.coded_weights)))
        if not self.coded_weights:
            return
        if not self.packed_weights or self.tensor_parallel != 1:
            raise ValueError("coded_weights need packed_weights=True and tensor_parallel=1")
        for role, bits in self.coded_weights:
            if role not in CODED_ROLES or bits not in (4, 8, WIDENED_BITS):
                raise ValueError(f"coded_weights entry {(role, bits)!r}: the role must be one "
                                 f"of {CODED_ROLES} and the bits 4, 8 or {WIDENED_BITS}")
        if not self.fused_gate_activation and self.code_bits("gate_up_proj") is not None:
            raise ValueError("coded gate_up_proj needs the fused SiLU gate (no MLP bias)")

    def code_bits(self, role: str) -> int | None:
        """The code width of the projection `role` (CODED_ROLES), None for float32 panels."""
        return dict(self.coded_weights).get(role)

    @property
    def gated_silu(self) -> bool:
        """A SiLU-gated MLP without biases, whose activation a packed gate/up
        projection can apply itself."""
        return self.activation is Activation.SILU and not self.mlp_bias

    @property
    def fused_gate_activation(self) -> bool:
        """The packed gate/up projection applies SiLU and the product itself
        (esurge.models.packed_linear.PackedGateUp): packed, SiLU, no MLP bias."""
        return self.packed_weights and self.gated_silu

    @property
    def padded_vocab_size(self) -> int:
        """Embedding and LM head rows: the vocabulary rounded up to the shards."""
        return -(-self.vocab_size // self.tensor_parallel) * self.tensor_parallel

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.layers)
