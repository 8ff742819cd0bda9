"""Which projections of a checkpoint serve from their integer codes, and their panels.

A GGUF stores most projections in block formats with an affine form
(esurge.models.weight_codes). Where the CPU kernels serve float32 on one
device, the loader keeps those projections as codes in column panels
(esurge.models.coded_linear) instead of float32 panels. The module tree is
one per model, so a role (CODED_ROLES: each layer's fused q/k/v, o, gate/up,
down, and the LM head) is coded only when every layer has codes for it with
one code width; any other role keeps float32 panels. A checkpoint of plain
floats (safetensors) has no codes; where it stores a role's every tensor in
bfloat16 and the model serves float32, that role keeps the bfloat16 values
(WIDENED_BITS; esurge.models.fusion packs them, cpu_kernels/widened_matmul.cc
widens them in registers): half the bytes of float32 panels, the same products.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from esurge.models.checkpoint import CheckpointSource, MissingTensorError
from esurge.models.coded_linear import pack_codes, pack_gate_up_codes
from esurge.models.decoder_config import WIDENED_BITS, DecoderConfig
from esurge.models.weight_codes import WeightCodes, concat_rows

__all__ = ["CodedPanels", "read_coded_panels", "widened_roles"]

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

    def widened(self, roles: tuple[str, ...]) -> CodedPanels:
        """The same codes with `roles` (none of them coded) served from their
        bfloat16 values; their panels are packed with the other float weights."""
        return CodedPanels({**self.bits, **dict.fromkeys(roles, WIDENED_BITS)}, self.layers,
                           self.lm_head)


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


def _all_bfloat16(source: CheckpointSource, names: list[str]) -> bool:
    try:
        return all(source.stores_bfloat16(name) for name in names)
    except MissingTensorError:
        return False


def widened_roles(source: CheckpointSource, config: DecoderConfig,
                  taken: dict[str, int]) -> tuple[str, ...]:
    """The roles (CODED_ROLES) not in `taken` whose every tensor the checkpoint
    stores in bfloat16 (read from its headers; config: the checkpoint's)."""
    roles = []
    for role, (module, parts) in _LAYER_ROLES.items():
        if role in taken or (role == "gate_up_proj" and not config.gated_silu):
            continue  # the widened gate/up kernel applies SiLU itself, as the coded one
        names = [f"model.layers.{layer}.{module}.{part}.weight"
                 for layer in range(config.num_layers) for part in parts]
        if _all_bfloat16(source, names):
            roles.append(role)
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    if ("lm_head" not in taken and _all_bfloat16(source, [head])
            and source.tensor_shape(head)[0] == config.padded_vocab_size):
        roles.append("lm_head")
    return tuple(roles)
