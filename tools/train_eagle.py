"""Train an EAGLE-1 or EAGLE-3 draft head for a target model on local text.

    .venv/bin/python tools/train_eagle.py --target T --out O --layout eagle1 --steps 50

The shipped head (models/tiny-stdlib-eagle, ~22 min on 2 CPU cores) came from:

    .venv/bin/python tools/train_eagle.py --target models/tiny-stdlib \
        --out models/tiny-stdlib-eagle --layout eagle3 --aux-layers 2,3,4 --draft-vocab 3072 \
        --steps 400 --log-every 20 --distill-prompts 384 --distill-tokens 128 \
        --eval-prompts 32 --eval-k 4

For a chat model (the default SmolLM2-135M-Instruct, a .gguf target works),
--chat trains on the target's own greedy answers to --distill-prompts chat
prompts (tools/chat_prompts.py, rendered with the model's chat template) and
evaluates on prompts about held-out topics:

    .venv/bin/python tools/train_eagle.py --target ~/.cache/esurge/models/\
        smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf --out H --chat \
        --draft-vocab 8192 --distill-prompts 1104 --distill-tokens 208 --steps 414 \
        --data-cache C.npz --eval-prompts 32

The target runs once per chat (tools/eagle_data.py): its features and labels
are kept, in C.npz with --data-cache, and a cache of fewer chats is extended.
With --answers A.npz the chats come from tools/eagle_answers.py (answered in
bulk, e.g. on a GPU) instead of the engine; its held-out chats are then scored
after training (each draft step's top-1 agreement with the target, prompt
positions included, so it reads higher than the engine's acceptance). The
shipped models/smollm2-eagle was trained that way on an H200 from the answers
to all 11,136 training prompts (the commands are in its training_info.json).

Data: windows of the given text files (default: the standard library files
of the default model's training split, tools/lm_data.py), plus, with
--distill-prompts N, the target's own greedy continuations of N training
prompts (the text a greedy engine will actually draft for). Features are
the target's hidden states computed by the engine's own jitted forward over
a paged cache, so they are exactly what the head sees at inference.

The head is trained with the drafting unrolled --unroll steps (see
tools/eagle_training.py), with AdamW on a warmup + cosine schedule,
and saved as a Hugging Face style directory (config.json, model.safetensors
with d2t/t2d for EAGLE-3). --eval-prompts N then measures the mean
acceptance length through the engine on held-out prompts and records it in
training_info.json beside the weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make `tools` and `esurge` importable
    sys.path.insert(0, str(REPO))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from esurge.config import CacheConfig, Config, SchedulerConfig, SpeculativeConfig  # noqa: E402
from esurge.models import load_model  # noqa: E402
from esurge.models.loader import LoadedModel  # noqa: E402
from esurge.spec_decode.checkpoint import eagle_config_dict, save_eagle_head  # noqa: E402
from esurge.spec_decode.config import EagleConfig, EagleLayout  # noqa: E402
from esurge.spec_decode.head import EagleState, init_head  # noqa: E402
from tools.eagle_chat import (  # noqa: E402
    Batch,
    chat_batches,
    chat_data,
    evaluate_chat,
    heldout_accuracy,
)
from tools.eagle_data import PAGE_SIZE, TargetFeatures, draft_vocabulary  # noqa: E402
from tools.eagle_output_init import freeze_output, target_output_params  # noqa: E402
from tools.eagle_training import LossWeights, make_train_step, sparse_labels  # noqa: E402
from tools.lm_data import read_texts, split_files, token_stream  # noqa: E402
from tools.tokenizer_training import stdlib_files  # noqa: E402

__all__ = ["main", "parse_args"]



def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="target model directory")
    p.add_argument("--out", type=Path, required=True, help="where to write the head")
    p.add_argument("--layout", choices=[x.value for x in EagleLayout], default="eagle3")
    p.add_argument("--aux-layers", default=None,
                   help="EAGLE-3 target layer inputs to fuse, e.g. 2,3,4 (index L = last "
                        "layer's output); default EAGLE-3's (2, L//2, L-3)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="EAGLE-3 draft vocabulary: the most frequent target tokens")
    p.add_argument("--text", type=Path, nargs="*", default=None,
                   help="text files or directories (*.py, *.txt); default: stdlib train split")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--unroll", type=int, default=3, help="draft steps unrolled in training")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--distill-prompts", type=int, default=0,
                   help="add the target's greedy continuations of this many prompts")
    p.add_argument("--distill-tokens", type=int, default=192)
    p.add_argument("--chat", action="store_true",
                   help="train on the target's answers to chat prompts (tools/chat_prompts.py) "
                        "instead of text files; evaluate on held-out topics")
    p.add_argument("--data-cache", type=Path, default=None,
                   help="--chat: keep the answers and the target's features in this .npz "
                        "file; reuse them when it exists (same target and --draft-vocab), "
                        "extended when it holds fewer than --distill-prompts chats")
    p.add_argument("--answers", type=Path, default=None,
                   help="--chat: take the answers from this tools/eagle_answers.py file "
                        "instead of running the engine (its held-out chats, if any, are "
                        "scored after training)")
    p.add_argument("--output-init", choices=("random", "target"), default="random",
                   help="EAGLE-3: start the head's final norm and LM head at random, or "
                        "from the target's final norm and LM head rows "
                        "(tools/eagle_output_init.py)")
    p.add_argument("--freeze-output", action="store_true",
                   help="with --output-init target: keep the output layer as initialised")
    p.add_argument("--max-train-seconds", type=float, default=None,
                   help="stop training after this long (the schedule is not shortened; "
                        "training_info.json records the steps taken)")
    p.add_argument("--eval-prompts", type=int, default=0)
    p.add_argument("--eval-k", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "context", "unroll", "log_every", "eval_k"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_train_seconds is not None and not args.max_train_seconds >= 0:
        p.error(f"--max-train-seconds must be >= 0, got {args.max_train_seconds}")
    if args.chat:
        from tools.chat_prompts import chat_prompts

        available = len(chat_prompts("train"))
        if not 1 <= args.distill_prompts <= available:
            p.error(f"--chat trains on the answers to --distill-prompts prompts: 1 to "
                    f"{available}, got {args.distill_prompts}")
        if args.text:
            p.error("--text and --chat exclude each other: --chat trains on chat answers")
        if args.layout != EagleLayout.EAGLE3.value:
            p.error("--chat trains an EAGLE-3 head (--layout eagle3): its kept features "
                    "carry no final hidden state for EAGLE-1's regression")
    elif args.data_cache is not None or args.answers is not None:
        p.error("--data-cache and --answers hold --chat training data: they need --chat")
    if args.output_init == "target" and args.layout != EagleLayout.EAGLE3.value:
        p.error("--output-init target needs --layout eagle3 (EAGLE-1 uses the target's "
                "LM head itself)")
    if args.freeze_output and args.output_init != "target":
        p.error("--freeze-output keeps the output layer the target gave: it needs "
                "--output-init target")
    return args


def _text_files(paths: list[Path] | None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files)."""
    if not paths:
        split = split_files(stdlib_files())
        return list(split.train), list(split.heldout)
    files: list[Path] = []
    for path in paths:
        files.extend(sorted(path.rglob("*.py")) + sorted(path.rglob("*.txt"))
                     if path.is_dir() else [path])
    split = split_files(files)
    return list(split.train), list(split.heldout)


def _head_config(args: argparse.Namespace, target: LoadedModel) -> dict[str, Any]:
    layout = EagleLayout(args.layout)
    aux = None
    if args.aux_layers:
        aux = tuple(int(x) for x in args.aux_layers.split(","))
    return eagle_config_dict(target.config, layout, aux_layer_ids=aux,
                             draft_vocab_size=args.draft_vocab,
                             intermediate_size=args.intermediate_size)


def _target_tokenizer(target_path: Path, target: LoadedModel) -> Tokenizer:
    """The target's tokenizer: its tokenizer.json, or the one rebuilt from a GGUF."""
    if target.source_kind == "gguf":
        if target.hf_tokenizer is None:
            raise ValueError(f"{target_path} carries no tokenizer")
        return target.hf_tokenizer.backend_tokenizer
    return Tokenizer.from_file(str(target_path / "tokenizer.json"))


def _distilled(target_dir: Path, stream: np.ndarray, args: argparse.Namespace,
               rng: np.random.Generator) -> np.ndarray:
    """Prompts from the stream continued greedily by the target: [N, context] windows."""
    from esurge import SamplingParams, eSurge

    prompt_len = args.context - args.distill_tokens
    if prompt_len < 8:
        raise ValueError(f"--distill-tokens {args.distill_tokens} leaves no prompt in a "
                         f"window of --context {args.context}")
    starts = rng.integers(0, len(stream) - prompt_len, args.distill_prompts)
    prompts = [stream[s:s + prompt_len].tolist() for s in starts]
    config = Config(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048,
                                    max_model_len=args.context + 1, chunked_prefill_enabled=True),
                    CacheConfig(num_pages=None, page_size=PAGE_SIZE, enable_prefix_caching=False))
    began = time.monotonic()
    with eSurge(target_dir, config, show_progress=False, warmup=False) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.distill_tokens,
                                                    ignore_eos=True))
    print(f"distilled {len(prompts)} continuations in {time.monotonic() - began:.0f}s",
          file=sys.stderr, flush=True)
    return np.array([p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)],
                    np.int32)


def _windows(stream: np.ndarray, distilled: np.ndarray | None, args: argparse.Namespace,
             rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Endless [B, context] batches: random windows, half distilled when there are any."""
    n = args.context
    while True:
        take = args.batch_size // 2 if distilled is not None and len(distilled) else 0
        starts = rng.integers(0, len(stream) - n, args.batch_size - take)
        rows = [stream[s:s + n] for s in starts]
        if take and distilled is not None:
            rows += list(distilled[rng.integers(0, len(distilled), take)])
        yield np.stack(rows).astype(np.int32)


def _text_batches(args: argparse.Namespace, target: LoadedModel, config: EagleConfig,
                  stream: np.ndarray, d2t: np.ndarray, rng: np.random.Generator
                  ) -> Iterator[Batch]:
    """Windows of the text (and distilled continuations), the target run on each batch."""
    distilled = _distilled(args.target, stream, args, rng) if args.distill_prompts else None
    target_fn = TargetFeatures(target, tuple(i - 1 for i in config.aux_layer_ids),
                               args.batch_size, args.context)
    valid = jnp.ones((args.batch_size, args.context), bool)
    for windows in _windows(stream, distilled, args, rng):
        feats, hidden, logits = target_fn(windows)
        yield feats, hidden, jnp.asarray(windows), sparse_labels(logits, jnp.asarray(d2t), valid)


def train(args: argparse.Namespace) -> tuple[EagleState, dict[str, Any], dict[str, Any]]:
    """Train the head; returns (state, its config.json, training summary)."""
    target = load_model(args.target, "float32")
    raw = _head_config(args, target)
    layout = EagleLayout(args.layout)
    config = EagleConfig.from_hf_dict(raw, layout, target.config.num_layers)
    raw["eagle_aux_hidden_state_layer_ids"] = list(config.aux_layer_ids) or None
    if raw["eagle_aux_hidden_state_layer_ids"] is None:
        del raw["eagle_aux_hidden_state_layer_ids"]
    rng = np.random.default_rng(args.seed)
    batches: Iterator[Batch]
    if args.chat:
        data = chat_data(args, target, config)
        d2t = data.d2t
        batches = chat_batches(data, args, rng)
    else:
        train_files, _ = _text_files(args.text)
        stream = token_stream(_target_tokenizer(args.target, target),
                              read_texts(tuple(train_files)))
        d2t = (draft_vocabulary(stream, config) if layout is EagleLayout.EAGLE3
               else np.zeros(config.draft_vocab_size, np.int64))
        batches = _text_batches(args, target, config, stream, d2t, rng)
    head = init_head(config, seed=args.seed, d2t=jnp.asarray(d2t))
    if args.output_init == "target":
        head = head.replace_params(target_output_params(head.params, target, d2t))
    warmup = min(args.warmup, args.steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps,
                                                  args.lr * 0.05)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.01))
    params = head.params
    if args.freeze_output:
        optimizer = freeze_output(optimizer, params)
    opt_state = optimizer.init(params)
    step_fn = make_train_step(optimizer, args.unroll, LossWeights())
    began, history = time.monotonic(), []
    for step in range(1, args.steps + 1):
        feats, hidden, tokens, labels = next(batches)
        params, opt_state, loss, metrics = step_fn(params, opt_state, head, target.model_state,
                                                   feats, hidden, tokens, labels)
        if step % args.log_every == 0 or step == args.steps:
            acc = np.asarray(metrics.accuracy)
            history.append({"step": step, "loss": float(loss), "accuracy": acc.tolist()})
            _progress(step, args, float(loss), acc, time.monotonic() - began)
        if args.max_train_seconds is not None and time.monotonic() - began > args.max_train_seconds:
            print(f"stopped after {step} steps (--max-train-seconds)", file=sys.stderr)
            break
    summary = {"steps": step, "tokens": step * args.batch_size * args.context,
               "seconds": round(time.monotonic() - began, 1), "history": history}
    head = head.replace_params(params)
    if args.chat and args.answers is not None:
        summary["heldout_draft_accuracy"] = heldout_accuracy(args, target, head)
        print(f"held-out draft-step accuracy: {summary['heldout_draft_accuracy']}",
              file=sys.stderr, flush=True)
    return head, raw, summary


def _progress(step: int, args: argparse.Namespace, loss: float, accuracy: np.ndarray,
              elapsed: float) -> None:
    rate = step * args.batch_size * args.context / max(elapsed, 1e-9)
    eta = (args.steps - step) * elapsed / step
    accs = " ".join(f"{a:.2f}" for a in accuracy)
    print(f"step {step:5d}/{args.steps} | loss {loss:.4f} | draft-step accuracy [{accs}] | "
          f"{rate:7.0f} tok/s | elapsed {elapsed:5.0f}s | ETA {eta:5.0f}s",
          file=sys.stderr, flush=True)


def evaluate(target_dir: Path, head_dir: Path, heldout: list[Path], num_prompts: int, k: int,
             seed: int = 0) -> dict[str, float]:
    """Mean acceptance length (greedy, k drafts) on prompts cut from held-out files."""
    from esurge import SamplingParams, eSurge

    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    stream = token_stream(tokenizer, read_texts(tuple(heldout)))
    rng = np.random.default_rng(seed)
    prompts = [stream[s:s + 128].tolist()
               for s in rng.integers(0, len(stream) - 128, num_prompts)]
    config = Config(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512,
                                    max_model_len=512, chunked_prefill_enabled=True),
                    CacheConfig(num_pages=None, page_size=PAGE_SIZE, enable_prefix_caching=True),
                    SpeculativeConfig(k, str(head_dir)))
    with eSurge(target_dir, config, show_progress=False, warmup=False) as llm:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
        stats = llm.runner.spec_stats
    if stats is None:
        raise RuntimeError("the evaluation engine ran without speculation")
    return {"k": k, "prompts": num_prompts, "mean_acceptance_length":
            round(stats.mean_acceptance_length, 3),
            "acceptance_rate": round(stats.acceptance_rate, 3)}


def main(argv: Sequence[str] | None = None) -> int:
    """Train, save and (optionally) evaluate a head."""
    args = parse_args(argv)
    state, raw, summary = train(args)
    save_eagle_head(args.out, raw, state, dtype="bfloat16")
    print(f"saved {args.out}", file=sys.stderr)
    if args.eval_prompts and args.chat:
        summary["eval"] = evaluate_chat(args.target, args.out, args.eval_prompts, args.eval_k)
        print(f"held-out acceptance: {summary['eval']}", file=sys.stderr)
    elif args.eval_prompts:
        _, heldout = _text_files(args.text)
        summary["eval"] = evaluate(args.target, args.out, heldout, args.eval_prompts,
                                   args.eval_k, args.seed)
        print(f"held-out acceptance: {summary['eval']}", file=sys.stderr)
    (args.out / "training_info.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, **summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
