"""Write tiny HF checkpoints as GGUF files, the way llama.cpp's converter lays them out.

transformers can read GGUF but not write it; the `gguf` package (llama.cpp's
own writer and quantizers) can. This mirrors what `convert_hf_to_gguf.py`
does for the six families we serve: llama.cpp's metadata keys, its tensor
names (gguf's name map), Llama's q/k row permutation, Gemma's norm stored as
1 + weight, 1-D tensors kept in F32, and a byte-level BPE tokenizer as
`tokenizer.ggml.*` arrays.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma2": "gemma2", "gemma3": "gemma3"}


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves the rotary halves of each head for its own rope.
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _write_config(writer: gguf.GGUFWriter, family: str, cfg: dict[str, Any]) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_name(f"tiny-{family}")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(rope.get("full_attention"), dict):
        theta = rope["full_attention"].get("rope_theta", theta)
    writer.add_rope_freq_base(float(theta))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if GGUF_ARCH[family] == "llama":
        writer.add_rope_dimension_count(head_dim)
    if family in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg["sliding_window"])
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if family == "gemma2" and cfg.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])


def _write_tokenizer(writer: gguf.GGUFWriter, directory: Path, chat_template: str | None) -> None:
    data = json.loads((directory / "tokenizer.json").read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    special = {t["content"]: t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    tokens = [""] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([int(gguf.TokenType.CONTROL) if t in special
                            else int(gguf.TokenType.NORMAL) for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def _tensor_type(name: str, array: np.ndarray, qtype: gguf.GGMLQuantizationType
                 ) -> gguf.GGMLQuantizationType:
    if array.ndim == 1 or array.shape[-1] % 32:
        return gguf.GGMLQuantizationType.F32
    return qtype


def export_gguf(directory: Path, family: str, out: Path, *,
                qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                tokenizer_dir: Path | None = None, chat_template: str | None = None) -> Path:
    """Write the safetensors checkpoint in `directory` (of `family`) to `out` as GGUF."""
    cfg = json.loads((directory / "config.json").read_text())
    arch_name = GGUF_ARCH[family]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(out), arch_name)
    _write_config(writer, family, cfg)
    if tokenizer_dir is not None:
        _write_tokenizer(writer, tokenizer_dir, chat_template)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    tensors = load_file(str(directory / "model.safetensors"))
    for hf_name, array in sorted(tensors.items()):
        base, _, suffix = hf_name.rpartition(".")
        mapped = names.get_name(base)
        if mapped is None:
            raise ValueError(f"llama.cpp's {arch_name} has no tensor for {hf_name}")
        gguf_name = f"{mapped}.{suffix}"
        data = array.astype(np.float32)
        if arch_name == "llama" and ".attn_q." in gguf_name:
            data = _permute(data, heads)
        elif arch_name == "llama" and ".attn_k." in gguf_name:
            data = _permute(data, kv_heads or heads)
        if family in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
            data = data + 1.0
        kind = _tensor_type(gguf_name, data, qtype)
        if kind is gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, data)
        elif kind is gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, data.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
