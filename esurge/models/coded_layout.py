"""Which projections of a checkpoint serve from their integer codes, and their panels.

A GGUF stores most projections in block formats with an affine form
(esurge.models.weight_codes). Where the CPU kernels serve float32 on one
device, the loader keeps those projections as codes in column panels
(esurge.models.coded_linear) instead of float32 panels. The module tree is
one per model, so a role (CODED_ROLES: each layer's fused q/k/v, o, gate/up,
down, and the LM head) is coded only when every layer has codes for it with
one code width; any other role keeps float32 panels. A checkpoint of plain
floats (safetensors) has no codes and loads as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from esurge.models.checkpoint import CheckpointSource
from esurge.models.coded_linear import pack_codes, pack_gate_up_codes
from esurge.models.decoder_config import DecoderConfig
from esurge.models.weight_codes import WeightCodes, concat_rows

__all__ = ["CodedPanels", "read_coded_panels"]

Panels = dict[str, np.ndarray]  # codes, scale, offset

# role -> (the layer's submodule, the HF projections fused into it, in order)
_LAYER_ROLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}


@dataclass(frozen=True, slots=True)
class CodedPanels:
    """The coded roles of a model: their code widths and packed panels."""

    bits: dict[str, int] = field(default_factory=dict)
    layers: list[dict[str, Panels]] = field(default_factory=list)  # per layer: role -> panels
    lm_head: Panels | None = None

    @property
    def coded_weights(self) -> tuple[tuple[str, int], ...]:
        """The DecoderConfig.coded_weights these panels serve."""
        return tuple(sorted(self.bits.items()))


def _fused_codes(source: CheckpointSource, layer: int, module: str,
                 parts: tuple[str, ...]) -> WeightCodes | None:
    codes = [source.read_codes(f"model.layers.{layer}.{module}.{part}.weight") for part in parts]
    return None if None in codes else concat_rows(codes)  # type: ignore[arg-type]


def _layer_role(source: CheckpointSource, config: DecoderConfig, role: str
                ) -> tuple[int, list[Panels]] | None:
    """(bits, panels per layer) of one layer role; None unless every layer is coded alike."""
    module, parts = _LAYER_ROLES[role]
    panels, widths = [], set()
    for layer in range(config.num_layers):
        codes = _fused_codes(source, layer, module, parts)
        if codes is None:
            return None
        widths.add(codes.bits)
        panels.append(pack_gate_up_codes(codes, config.intermediate_size)
                      if role == "gate_up_proj" else pack_codes(codes))
    return (widths.pop(), panels) if len(widths) == 1 else None


def read_coded_panels(source: CheckpointSource, config: DecoderConfig) -> CodedPanels:
    """The panels of every role the checkpoint holds as codes (config: the
    checkpoint's, one device)."""
    bits: dict[str, int] = {}
    layers: list[dict[str, Panels]] = [{} for _ in range(config.num_layers)]
    for role in _LAYER_ROLES:
        if role == "gate_up_proj" and not config.gated_silu:
            continue  # the coded gate/up kernel applies SiLU itself
        found = _layer_role(source, config, role)
        if found is not None:
            bits[role] = found[0]
            for layer, panels in zip(layers, found[1], strict=True):
                layer[role] = panels
    head = source.read_codes("model.embed_tokens.weight" if config.tie_word_embeddings
                             else "lm_head.weight")
    if head is None or head.shape[0] != config.padded_vocab_size:
        return CodedPanels(bits, layers)
    bits["lm_head"] = head.bits
    return CodedPanels(bits, layers, pack_codes(head))
