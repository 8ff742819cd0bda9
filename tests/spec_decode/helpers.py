"""Targets and Eagle heads built locally for the speculative decoding tests.

- `random_head`: a random EAGLE-1 or EAGLE-3 head for any target (low
  acceptance; greedy output must not change).
- `AloneOnly`: a policy drafting only where a request runs alone (moving
  requests back, head_sync.py).
- `bigram_pair`: a Llama whose attention outputs are zeroed and whose second
  layer's MLP is zeroed, so its next token depends on the current token
  only, plus an EAGLE-1 head that recomputes that function exactly (fc keeps
  the token embedding, the draft layer copies the target's first MLP). Its
  greedy drafts are always right; `perturb` adds noise to the draft's MLP so
  only some are. Under sampling its distribution differs from the target's
  (no final norm), so both acceptance and rejection happen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from safetensors.numpy import save_file

from esurge.config import CacheConfig, Config, SchedulerConfig, SpeculativeConfig
from esurge.models import load_model
from esurge.spec_decode.checkpoint import eagle_config_dict, save_eagle_head
from esurge.spec_decode.config import EagleConfig, EagleLayout
from esurge.spec_decode.head import init_head
from esurge.spec_decode.policy import SpeculationPolicy

__all__ = ["AloneOnly", "bigram_next_probs", "bigram_pair", "random_head", "spec_config"]

MAX_MODEL_LEN = 96


def spec_config(k: int | None, head: Path | None, *, max_num_seqs: int = 8,
                num_pages: int = 160, prefix: bool = True, async_: bool = False,
                chunked: bool = True, max_model_len: int = MAX_MODEL_LEN,
                batched_tokens: int = 32) -> Config:
    """A small engine config; k None (or head None) turns speculation off."""
    spec = None if k is None or head is None else SpeculativeConfig(k, str(head))
    return Config(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=batched_tokens,
                        max_model_len=max_model_len, chunked_prefill_enabled=chunked,
                        long_prefill_token_threshold=16 if chunked else 0,
                        max_num_seq_buckets=(max_num_seqs,), async_scheduling=async_),
        CacheConfig(num_pages=num_pages, page_size=8, enable_prefix_caching=prefix),
        spec,
    )


def random_head(target_dir: Path, out_dir: Path, layout: EagleLayout, seed: int,
                aux_layer_ids: tuple[int, ...] | None = None,
                draft_vocab_size: int | None = None) -> Path:
    """A random head for the checkpoint in target_dir (EAGLE-3: the first
    draft_vocab_size ids shifted by one, so d2t is not the identity)."""
    target = load_model(target_dir).config
    raw = eagle_config_dict(target, layout, aux_layer_ids=aux_layer_ids,
                            draft_vocab_size=draft_vocab_size)
    config = EagleConfig.from_hf_dict(raw, layout, target.num_layers)
    d2t = None
    if layout is EagleLayout.EAGLE3:
        d2t = jnp.ones(config.draft_vocab_size, jnp.int32)  # draft id d is target id d + 1
    return save_eagle_head(out_dir, raw, init_head(config, seed=seed, d2t=d2t, scale=0.2))


def _bigram_target(path: Path, vocab: int, seed: int) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.5, tie_word_embeddings=False, eos_token_id=None,
        bos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        model.model.layers[1].mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        layer0 = model.model.layers[0]
        layer0.post_attention_layernorm.weight.add_(torch.randn(64) * 0.2)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path, safe_serialization=True)
    return model


def bigram_pair(root: Path, *, vocab: int = 16, seed: int = 0,
                perturb: float = 0.0) -> tuple[Path, Path]:
    """(target dir, EAGLE-1 head dir); see the module docstring."""
    target_dir, head_dir = root / "bigram_target", root / f"bigram_head_{perturb}"
    if not target_dir.exists():
        _bigram_target(target_dir, vocab, seed)
    model = transformers.LlamaForCausalLM.from_pretrained(target_dir).eval()
    rng = np.random.default_rng(seed + 1)
    layer0 = model.model.layers[0]
    h = 64

    def weight(module: Any, noise: float = 0.0) -> np.ndarray:
        value = module.weight.detach().numpy().astype(np.float32)
        return value + noise * rng.standard_normal(value.shape).astype(np.float32)

    tensors = {
        "fc.weight": np.concatenate([np.eye(h), np.zeros((h, h))], axis=1).astype(np.float32),
        "layers.0.self_attn.q_proj.weight": rng.standard_normal((h, h)).astype(np.float32),
        "layers.0.self_attn.k_proj.weight": rng.standard_normal((32, h)).astype(np.float32),
        "layers.0.self_attn.v_proj.weight": rng.standard_normal((32, h)).astype(np.float32),
        "layers.0.self_attn.o_proj.weight": np.zeros((h, h), np.float32),
        "layers.0.post_attention_layernorm.weight": weight(layer0.post_attention_layernorm),
        "layers.0.mlp.gate_proj.weight": weight(layer0.mlp.gate_proj, perturb),
        "layers.0.mlp.up_proj.weight": weight(layer0.mlp.up_proj, perturb),
        "layers.0.mlp.down_proj.weight": weight(layer0.mlp.down_proj, perturb),
    }
    head_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(head_dir / "model.safetensors"))
    raw = eagle_config_dict(load_model(target_dir).config, EagleLayout.EAGLE1)
    (head_dir / "config.json").write_text(__import__("json").dumps(raw))
    return target_dir, head_dir


def bigram_next_probs(target_dir: Path, temperature: float = 1.0) -> np.ndarray:
    """[vocab, vocab]: row a is the target's next-token distribution after token a."""
    model = transformers.LlamaForCausalLM.from_pretrained(target_dir).eval()
    vocab = model.config.vocab_size
    with torch.no_grad():
        logits = model(torch.arange(vocab)[:, None]).logits[:, -1].double()
    return torch.softmax(logits / temperature, dim=-1).numpy()


class AloneOnly(SpeculationPolicy):
    """Steps draft only alone; with `prompts`, prompts always pass through the head."""

    def __init__(self, prompts: bool) -> None:
        self.prompts = prompts

    def speculate(self, batch: int, measurable: bool = True) -> bool:
        return batch == 1 or (self.prompts and batch > 0 and not measurable)
