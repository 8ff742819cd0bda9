"""An Eagle head for a chat model: trained on the target's own answers to chat
prompts (tools/chat_prompts.py), evaluated on prompts about held-out topics.

The target answers each training prompt greedily through the engine; each
chat (prompt and answer) is then run through the target once and kept with
its features and labels (tools/eagle_data.py, --data-cache).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from esurge.config import CacheConfig, Config, SchedulerConfig, SpeculativeConfig
from esurge.models.loader import LoadedModel
from esurge.spec_decode.config import EagleConfig
from esurge.spec_decode.head import EagleState
from tools.eagle_answers import read_split
from tools.eagle_data import PAGE_SIZE, FeatureSet, TargetFeatures, draft_vocabulary
from tools.eagle_training import Labels, LossWeights, head_loss

__all__ = ["answered", "chat_batches", "chat_config", "chat_data", "chat_sequences",
           "evaluate_chat", "heldout_accuracy"]

Batch = tuple[jax.Array, jax.Array, jax.Array, Labels]  # features, final hidden, tokens, labels


def chat_config(context: int, spec: SpeculativeConfig | None = None) -> Config:
    return Config(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048,
                                  max_model_len=context, chunked_prefill_enabled=True),
                  CacheConfig(num_pages=None, page_size=PAGE_SIZE, enable_prefix_caching=True),
                  spec)


def chat_sequences(args: argparse.Namespace, start: int = 0) -> list[np.ndarray]:
    """The target's greedy answers to training chat prompts start..--distill-prompts,
    each with its prompt (answers end where the model ends its turn, or at
    --distill-tokens)."""
    from esurge import SamplingParams, eSurge
    from esurge.engine.chat import ChatMessage, ChatPrompt
    from tools.chat_prompts import chat_prompts

    prompts = chat_prompts("train")[start:args.distill_prompts]
    chats = [ChatPrompt((ChatMessage("user", p),)) for p in prompts]
    began = time.monotonic()
    # Room for the rendered prompt (tens of tokens) before the answer.
    with eSurge(args.target, chat_config(256 + args.distill_tokens), show_progress=False,
                warmup=False) as llm:
        outs = llm.generate(chats, SamplingParams(temperature=0, max_tokens=args.distill_tokens))
    sequences = [np.asarray([*o.prompt_token_ids, *o.outputs[0].token_ids], np.int64)
                 for o in outs]
    print(f"answered {len(prompts)} chat prompts ({sum(map(len, sequences))} tokens) in "
          f"{time.monotonic() - began:.0f}s", file=sys.stderr, flush=True)
    return sequences


def chat_data(args: argparse.Namespace, target: LoadedModel, config: EagleConfig
               ) -> FeatureSet:
    """The chat sequences with the target's features and labels: from --data-cache
    when it holds them, else computed (and written there when given). A cache
    of fewer than --distill-prompts chats is extended with the answers to the
    next prompts, labelled over its own draft vocabulary."""
    kept: FeatureSet | None = None
    if args.data_cache is not None and args.data_cache.is_file():
        kept = FeatureSet.load(args.data_cache)
        if len(kept.d2t) != config.draft_vocab_size:
            raise ValueError(f"{args.data_cache} was computed for a draft vocabulary of "
                             f"{len(kept.d2t)}, not --draft-vocab {config.draft_vocab_size}")
        print(f"read {len(kept.tokens)} sequences ({kept.num_tokens} tokens) from "
              f"{args.data_cache}", file=sys.stderr, flush=True)
        if len(kept.tokens) >= args.distill_prompts:
            return kept
    start = 0 if kept is None else len(kept.tokens)
    sequences = (answered(args.answers, "train", start, args.distill_prompts)
                 if args.answers is not None else chat_sequences(args, start=start))
    d2t = draft_vocabulary(np.concatenate(sequences), config) if kept is None else kept.d2t
    cut = sum(len(s) > args.context for s in sequences)
    if cut:
        print(f"{cut} sequences longer than --context {args.context} are cut", file=sys.stderr)
    target_fn = TargetFeatures(target, tuple(i - 1 for i in config.aux_layer_ids),
                               args.batch_size, args.context)
    began = time.monotonic()

    def progress(done: int, total: int) -> None:
        print(f"target features: {done}/{total} sequences, {time.monotonic() - began:.0f}s",
              file=sys.stderr, flush=True)

    data = FeatureSet.compute(target_fn, sequences, args.context, d2t, args.batch_size,
                              progress)
    if kept is not None:
        data = kept.extended(data)
    if args.data_cache is not None:
        data.save(args.data_cache)
    return data


def answered(path: Path, split: str, start: int, stop: int) -> list[np.ndarray]:
    """Chats start..stop of a split of a tools/eagle_answers.py answer file."""
    chats = read_split(path, split)
    if len(chats) < stop:
        raise ValueError(f"{path} holds {len(chats)} {split} chats, fewer than the {stop} asked")
    print(f"read {stop - start} {split} chats from {path}", file=sys.stderr, flush=True)
    return chats[start:stop]


def heldout_accuracy(args: argparse.Namespace, target: LoadedModel, head: EagleState
                     ) -> list[float]:
    """Each unrolled draft step's top-1 agreement with the target on the held-out
    chats of --answers: a quick relative signal where the engine cannot run.
    It counts prompt positions too (the chat template and its system text,
    which the head predicts easily), so it reads well above the acceptance
    the engine measures on answers (0.71 for the first step of a head whose
    engine acceptance length at k = 4 was 2.1)."""
    with np.load(args.answers) as data:
        count = len(data["heldout_offsets"]) - 1
    if count < args.batch_size:
        return []
    config, d2t = head.config, np.asarray(head.d2t)
    target_fn = TargetFeatures(target, tuple(i - 1 for i in config.aux_layer_ids),
                               args.batch_size, args.context)
    data = FeatureSet.compute(target_fn, answered(args.answers, "heldout", 0, count),
                              args.context, d2t, args.batch_size)
    loss = jax.jit(head_loss, static_argnums=(7, 8))
    total, weight = np.zeros(args.unroll), 0
    batches = data.batches(args.batch_size, np.random.default_rng(0))
    for _ in range(count // args.batch_size):
        feats, tokens, labels = next(batches)
        _, metrics = loss(head.params, head, target.model_state, jnp.asarray(feats),
                          jnp.zeros((0,), jnp.float32), jnp.asarray(tokens), labels,
                          args.unroll, LossWeights())
        total, weight = total + np.asarray(metrics.accuracy), weight + 1
    return [round(float(a), 4) for a in total / weight]


def evaluate_chat(target_path: Path, head_dir: Path, num_prompts: int, k: int,
                  max_tokens: int = 128) -> dict[str, float]:
    """Mean acceptance length (greedy, k drafts) on chat prompts about held-out topics."""
    from esurge import SamplingParams, eSurge
    from esurge.engine.chat import ChatMessage, ChatPrompt
    from tools.chat_prompts import chat_prompts

    prompts = chat_prompts("heldout")[::max(1, len(chat_prompts("heldout")) // num_prompts)]
    chats = [ChatPrompt((ChatMessage("user", p),)) for p in prompts[:num_prompts]]
    with eSurge(target_path, chat_config(512, SpeculativeConfig(k, str(head_dir))),
                show_progress=False, warmup=False, speculation="always") as llm:
        llm.generate(chats, SamplingParams(temperature=0, max_tokens=max_tokens))
        stats = llm.runner.spec_stats
    if stats is None:
        raise RuntimeError("the evaluation engine ran without speculation")
    return {"k": k, "prompts": len(chats), "mean_acceptance_length":
            round(stats.mean_acceptance_length, 3),
            "acceptance_rate": round(stats.acceptance_rate, 3)}


def chat_batches(data: FeatureSet, args: argparse.Namespace, rng: np.random.Generator
                  ) -> Iterator[Batch]:
    """Whole chats with their kept features (EAGLE-3: no final hidden needed)."""
    none = jnp.zeros((0,), jnp.float32)
    for feats, tokens, labels in data.batches(args.batch_size, rng):
        yield jnp.asarray(feats), none, jnp.asarray(tokens), labels
