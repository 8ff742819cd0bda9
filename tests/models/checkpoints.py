"""Tiny random HF checkpoints of every supported family, built locally with transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "initializer_range": 0.15,
}
WINDOW = 8  # shorter than every test sequence


def hf_config(family: str, **overrides: Any) -> transformers.PreTrainedConfig:
    """A tiny config of one family; overrides replace any field."""
    fields = dict(COMMON)
    if family == "llama":
        cls: Any = transformers.LlamaConfig
    elif family == "mistral":
        cls, fields["sliding_window"] = transformers.MistralConfig, WINDOW
    elif family == "qwen2":
        cls, fields["tie_word_embeddings"] = transformers.Qwen2Config, True
    elif family == "qwen3":
        cls, fields["head_dim"] = transformers.Qwen3Config, 24
    elif family == "gemma2":
        cls = transformers.Gemma2Config
        # Three layers make two sliding groups and one full group; caps small enough to bite.
        # Untied: a tiny random Gemma with tied embeddings greedily repeats one token.
        fields.update(num_hidden_layers=3, tie_word_embeddings=False, head_dim=16,
                      sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                      final_logit_softcapping=4.0)
    elif family == "gemma3":
        cls = transformers.Gemma3TextConfig
        fields.update(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=32,
                      tie_word_embeddings=False,
                      final_logit_softcapping=4.0,
                      layer_types=["sliding_attention", "full_attention"])
    else:
        raise ValueError(f"unknown test family {family!r}")
    fields.update(overrides)
    return cls(**fields)


def build_model(config: transformers.PreTrainedConfig, seed: int) -> Any:
    """A random float32 eager-attention model whose norms and biases are random too."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # norm weights and biases start at constants
                param.add_(torch.randn_like(param) * 0.2)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def save_checkpoint(model: Any, path: Path, **save_kwargs: Any) -> Path:
    """save_pretrained with safetensors into path."""
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return path
