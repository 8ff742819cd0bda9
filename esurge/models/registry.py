"""Which HF `architectures` names we can run, and with which family policy."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from esurge.models.families import (
    GEMMA2,
    GEMMA3,
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    FamilyPolicy,
)

__all__ = ["ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "architecture_of", "policy_for"]

ARCHITECTURES: MappingProxyType[str, FamilyPolicy] = MappingProxyType({
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": MISTRAL,
    "Qwen2ForCausalLM": QWEN2,
    "Qwen3ForCausalLM": QWEN3,
    "Gemma2ForCausalLM": GEMMA2,
    "Gemma3ForCausalLM": GEMMA3,
})

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)


def policy_for(architecture: str) -> FamilyPolicy:
    """The family policy of a HF architecture name; ValueError naming the supported ones."""
    policy = ARCHITECTURES.get(architecture)
    if policy is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return policy


def architecture_of(hf_config: Any) -> str:
    """The single architecture a HF config declares."""
    names = getattr(hf_config, "architectures", None) or []
    if len(names) != 1:
        raise ValueError(
            f"config.json must name exactly one architecture, got {names!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(names[0])
