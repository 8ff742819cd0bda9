"""The static description of an Eagle draft head, read from its HF-style config.json.

Two published layouts are supported:

- EAGLE-1 (`layers.N.*`, `fc.weight` over [token embedding; target hidden]):
  decoder layers fed by `fc`, the first one without an input norm; the draft
  shares the target's embedding and LM head, and its features are the
  target's final (normed) hidden states.
- EAGLE-3 (`midlayer.*`, `fc.weight` over three target layers, `norm`,
  `lm_head`, `d2t`, `t2d`): one layer whose attention reads [normed token
  embedding; normed hidden] (2 x hidden wide), its own LM head over a reduced
  draft vocabulary mapped back to target ids by `d2t`.

`aux_layer_ids` follow the EAGLE-3 / vLLM convention
(`eagle_aux_hidden_state_layer_ids`): index i names the residual stream
*entering* target layer i, i.e. the output of layer i - 1; index L (an
extension) names the output of the last layer, before the final norm. The
default is (2, L // 2, L - 3) for an L-layer target, as the EAGLE-3 reference
code picks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from types import SimpleNamespace
from typing import Any

from esurge.models.decoder_config import Activation, AttentionKind, RopeConfig
from esurge.models.families import rope_config_from_hf

__all__ = ["EagleConfig", "EagleLayout", "default_aux_layer_ids"]


class EagleLayout(StrEnum):
    """Which published Eagle checkpoint layout a head uses."""

    EAGLE1 = "eagle1"
    EAGLE3 = "eagle3"


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"draft config field {name} must be an int >= 1, got {value!r}")
    return value


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice of target layer inputs (low, middle, high), deduplicated."""
    picked = sorted({2, num_target_layers // 2, num_target_layers - 3})
    return tuple(picked)


@dataclass(frozen=True, slots=True)
class EagleConfig:
    """Everything the draft head's modules need; hashable (it is static under jit)."""

    layout: EagleLayout
    hidden_size: int
    target_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    activation: Activation
    rope: RopeConfig
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] = ()
    fc_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", EagleLayout(self.layout))
        object.__setattr__(self, "activation", Activation(self.activation))
        for name in ("hidden_size", "target_hidden_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                     "draft_vocab_size"):
            _positive(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"draft num_attention_heads ({self.num_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_kv_heads})")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size "
                             f"({self.vocab_size})")
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))
        if self.layout is EagleLayout.EAGLE3:
            if len(self.aux_layer_ids) != 3:
                raise ValueError(f"an EAGLE-3 head fuses 3 target layers, got aux_layer_ids "
                                 f"{self.aux_layer_ids!r}")
            if self.num_layers != 1:
                raise ValueError(f"an EAGLE-3 head has one midlayer, config says "
                                 f"num_hidden_layers={self.num_layers}")
        elif self.draft_vocab_size != self.vocab_size:
            raise ValueError(f"an EAGLE-1 head shares the target's LM head: draft_vocab_size "
                             f"({self.draft_vocab_size}) must equal vocab_size ({self.vocab_size})")

    @property
    def feature_size(self) -> int:
        """Width of the target features the head consumes per token."""
        if self.layout is EagleLayout.EAGLE3:
            return 3 * self.target_hidden_size
        return self.target_hidden_size

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], layout: EagleLayout,
                     num_target_layers: int) -> EagleConfig:
        """Read a draft config.json (already parsed) for a head of `layout`."""
        if not isinstance(raw, dict):
            raise ValueError(f"draft config.json must hold a JSON object, got {type(raw).__name__}")
        get = raw.get
        hidden = _positive("hidden_size", get("hidden_size"))
        heads = _positive("num_attention_heads", get("num_attention_heads"))
        vocab = _positive("vocab_size", get("vocab_size"))
        act = get("hidden_act", "silu")
        if act not in {a.value for a in Activation}:
            raise ValueError(f"draft config field hidden_act {act!r} is not supported")
        rope = rope_config_from_hf(SimpleNamespace(**raw), AttentionKind.FULL)
        aux: tuple[int, ...] = ()
        if layout is EagleLayout.EAGLE3:
            aux = _aux_ids(raw, num_target_layers)
        return cls(
            layout=layout,
            hidden_size=hidden,
            target_hidden_size=int(get("target_hidden_size") or hidden),
            num_layers=int(get("num_hidden_layers", 1)),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            intermediate_size=_positive("intermediate_size", get("intermediate_size")),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            activation=Activation(act),
            rope=rope,
            vocab_size=vocab,
            draft_vocab_size=int(get("draft_vocab_size") or vocab),
            aux_layer_ids=aux,
            fc_bias=bool(get("bias", False)) and layout is EagleLayout.EAGLE1,
            attention_bias=bool(get("attention_bias", False)),
            mlp_bias=bool(get("mlp_bias", False)),
            norm_before_residual=bool(get("norm_before_residual", False)),
        )


def _aux_ids(raw: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    nested = raw.get("eagle_config")
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and isinstance(nested, dict):
        ids = nested.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = default_aux_layer_ids(num_target_layers)
        if len(ids) != 3:
            raise ValueError(
                f"the target has {num_target_layers} layers, too few for EAGLE-3's default "
                f"layers (2, L // 2, L - 3); set eagle_aux_hidden_state_layer_ids in the draft "
                "config.json")
    ids = tuple(ids)
    bad = [i for i in ids if not isinstance(i, int) or not 1 <= i <= num_target_layers]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {ids!r} must be distinct target layer indices "
            f"in [1, {num_target_layers}] (index i is the input of target layer i)")
    return ids
