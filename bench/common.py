"""Shared pieces of the benchmarks: checkpoints made here, workload W1, timing."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = ["MODEL_SHAPES", "make_checkpoint", "timed", "workload_w1"]

# (hidden, layers, heads, kv_heads, intermediate)
MODEL_SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (256, 4, 4, 2, 688),
    "150m": (1024, 12, 16, 8, 2816),
}


def make_checkpoint(out: Path, shape: str, vocab: int = 4096, max_len: int = 2048,
                    dtype: str = "float32") -> Path:
    """A random-initialised Llama checkpoint (its weights stored in dtype) plus a
    4096-token tokenizer trained here."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tools.tokenizer_training import stdlib_texts, train_bpe_tokenizer

    if (out / "config.json").is_file():
        return out
    hidden, layers, heads, kv_heads, inter = MODEL_SHAPES[shape]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max_len,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).eval().to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    train_bpe_tokenizer(stdlib_texts(max_files=100), vocab_size=vocab, out_dir=out)
    return out


def workload_w1(tokenizer_dir: Path, num_sets: int, per_set: int = 32, seed: int = 0
                ) -> list[list[list[int]]]:
    """num_sets sets of per_set prompts, 64-128 tokens each, cut from stdlib source.

    Every prompt comes from a different place, so no set shares a prefix with another.
    """
    from tokenizers import Tokenizer

    from tools.tokenizer_training import stdlib_texts

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = tok.encode("\n".join(stdlib_texts(max_files=60, skip=100))).ids
    rng = np.random.default_rng(seed)
    lengths = rng.integers(64, 129, size=num_sets * per_set)
    starts = np.cumsum(np.concatenate([[0], lengths[:-1] + 17]))
    if starts[-1] + lengths[-1] > len(ids):
        raise ValueError("not enough standard-library text for the workload")
    prompts = [ids[s:s + n] for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)]
    return [prompts[i * per_set:(i + 1) * per_set] for i in range(num_sets)]


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
