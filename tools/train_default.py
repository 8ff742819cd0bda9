"""Train the default model (models/tiny-stdlib): a small Llama on the Python standard library.

    nice -n 10 .venv/bin/python tools/train_default.py            # the shipped model
    .venv/bin/python tools/train_default.py --smoke --work-dir W --out-dir O   # seconds

Steps: split the stdlib's top-level *.py files (tools/lm_data.py documents the
split), train a 4096-token byte-level BPE tokenizer on the training files,
train the model with AdamW (warmup + cosine), evaluate on the held-out files
and export a Hugging Face checkpoint. Everything is deterministic given
--seed. A checkpoint (weights, optimizer state, step, data cursor) is saved
to --work-dir every --checkpoint-every steps; rerun the same command with
--resume to continue. --stop-at-step ends a run early (checkpointed,
evaluated and exported as it stands), as an interruption would.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make `tools` and `esurge` importable
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from tools.lm_checkpoint import TrainState, export_hf, load_checkpoint, save_checkpoint  # noqa: E402
from tools.lm_data import (  # noqa: E402
    WindowSampler,
    eval_windows,
    read_texts,
    split_files,
    token_stream,
    unigram_nll,
)
from tools.lm_training import (  # noqa: E402
    ModelShape,
    OptimizerSpec,
    build_model,
    init_params,
    make_optimizer,
    make_schedule,
    token_losses,
    train_step,
)
from tools.tokenizer_training import stdlib_files, train_bpe_tokenizer  # noqa: E402

__all__ = ["main", "parse_args"]

FULL_DEFAULTS: dict[str, Any] = {
    "vocab_size": 4096, "hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
    "intermediate_size": 688, "context": 512, "batch_size": 8, "steps": 300, "warmup_steps": 25,
    "max_files": None, "checkpoint_every": 25, "eval_every": 50, "log_every": 5,
    "quick_eval_windows": 16, "work_dir": "/tmp/train_default", "out_dir": "models/tiny-stdlib",
}
# A tiny model on a dozen files: exercises every stage in seconds (used by the tests).
SMOKE_DEFAULTS: dict[str, Any] = {
    **FULL_DEFAULTS, "vocab_size": 320, "hidden_size": 32, "num_layers": 1, "num_heads": 2,
    "num_kv_heads": 1, "intermediate_size": 64, "context": 32, "batch_size": 4, "steps": 8,
    "warmup_steps": 2, "max_files": 12, "checkpoint_every": 4, "eval_every": 4, "log_every": 1,
    "quick_eval_windows": 4, "work_dir": None, "out_dir": None,
}
# Settings that change the result; a resumed run must use the same ones.
RESULT_SETTINGS = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
    "context", "batch_size", "steps", "warmup_steps", "peak_lr", "final_lr", "weight_decay",
    "seed", "max_files", "isolate_newlines",
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; --smoke swaps in the tiny defaults (explicit flags still win)."""
    smoke = "--smoke" in (sys.argv[1:] if argv is None else argv)
    defaults = SMOKE_DEFAULTS if smoke else FULL_DEFAULTS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, few steps, 12 files")
    p.add_argument("--resume", action="store_true", help="continue from --work-dir")
    p.add_argument("--work-dir", type=Path, required=defaults["work_dir"] is None)
    p.add_argument("--out-dir", type=Path, required=defaults["out_dir"] is None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-lr", type=float, default=3e-3)
    p.add_argument("--final-lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--isolate-newlines", action="store_true",
                   help="tokenizer: every newline is its own token (not used for the shipped "
                        "model; see models/tiny-stdlib/README.md)")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="end this run after this step (as if interrupted)")
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "intermediate_size", "context", "batch_size", "steps", "warmup_steps",
                 "max_files", "checkpoint_every", "eval_every", "log_every",
                 "quick_eval_windows"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=defaults[name])
    p.set_defaults(work_dir=defaults["work_dir"], out_dir=defaults["out_dir"])
    args = p.parse_args(argv)
    for name in ("checkpoint_every", "eval_every", "log_every", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def _prepare_data(args: argparse.Namespace, tok_dir: Path, resume: bool
                  ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Train and held-out token streams, and the held-out file names."""
    files = stdlib_files()
    split = split_files(files[:args.max_files] if args.max_files is not None else files)
    train_texts = read_texts(split.train)
    if not (resume and (tok_dir / "tokenizer.json").is_file()):
        train_bpe_tokenizer(train_texts, args.vocab_size, tok_dir,
                            isolate_newlines=args.isolate_newlines)
    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    train = token_stream(tokenizer, train_texts)
    heldout = token_stream(tokenizer, read_texts(split.heldout))
    return train, heldout, [p.name for p in split.heldout]


def _compile(graphdef: Any, spec: OptimizerSpec
             ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The train step and per-token loss with the model and optimizer bound."""
    return (partial(train_step, graphdef=graphdef, spec=spec),
            partial(token_losses, graphdef=graphdef))


def evaluate(token_losses: Callable[..., Any], params: Any, windows: np.ndarray,
             batch_size: int) -> float:
    """Mean next-token loss (nats) over all windows; the last batch is padded, then cut."""
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        chunk = windows[start:start + batch_size]
        padded = np.concatenate([chunk, np.repeat(chunk[:1], batch_size - len(chunk), 0)])
        losses = np.asarray(token_losses(params, jnp.asarray(padded)))[:len(chunk)]
        total += float(losses.sum(dtype=np.float64))
        count += losses.size
    return total / count


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Step lines on stderr: loss, learning rate, tokens/s, elapsed, ETA."""

    def __init__(self, first_step: int, total: int, tokens_per_step: int) -> None:
        self.total, self.tokens_per_step = total, tokens_per_step
        self.start = time.monotonic()
        # The first step compiles; rates are measured from its end.
        self.mark_step, self.mark_time = first_step + 1, 0.0

    def step_done(self, step: int, loss: float, lr: float, every: int) -> None:
        now = time.monotonic() - self.start
        if step == self.mark_step:
            self.mark_time = now
        if step % every and step != self.total:
            return
        steps = step - self.mark_step
        rate = steps / (now - self.mark_time) if steps > 0 and now > self.mark_time else 0.0
        eta = _clock((self.total - step) / rate) if rate else "?"
        print(f"step {step:5d}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | "
              f"{rate * self.tokens_per_step:8.0f} tok/s | elapsed {_clock(now)} | ETA {eta}",
              file=sys.stderr, flush=True)

    def exclude(self, seconds: float) -> None:
        """Leave time spent on something else (evaluation) out of the rates."""
        self.mark_time += seconds

    def tokens_per_second(self, last_step: int) -> float:
        """Average training throughput after compilation."""
        elapsed = time.monotonic() - self.start - self.mark_time
        steps = last_step - self.mark_step
        return steps * self.tokens_per_step / elapsed if steps > 0 and elapsed > 0 else 0.0


def _train_loop(args: argparse.Namespace, state: TrainState, sampler: WindowSampler,
                fns: tuple[Callable[..., Any], Callable[..., Any]], quick_eval: np.ndarray,
                settings: dict[str, Any], schedule: optax.Schedule
                ) -> tuple[TrainState, list[float], float]:
    train_step, token_losses = fns
    last = args.steps if args.stop_at_step is None else min(args.steps, args.stop_at_step)
    progress = Progress(state.step, last, args.batch_size * args.context)
    losses: list[float] = []
    while state.step < last:
        tokens = jnp.asarray(sampler.batch(state.cursor, args.batch_size))
        state.params, state.opt_state, loss = train_step(state.params, state.opt_state, tokens)
        state.step, state.cursor = state.step + 1, state.cursor + args.batch_size
        losses.append(float(loss))
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"training diverged: loss {losses[-1]} at step {state.step}")
        progress.step_done(state.step, losses[-1], float(schedule(state.step - 1)),
                           args.log_every)
        if state.step % args.eval_every == 0 and state.step != last:
            began = time.monotonic()
            quick = evaluate(token_losses, state.params, quick_eval, args.batch_size)
            progress.exclude(time.monotonic() - began)
            print(f"step {state.step:5d} | held-out loss (first {len(quick_eval)} windows) "
                  f"{quick:.4f}", file=sys.stderr, flush=True)
        if state.step % args.checkpoint_every == 0 or state.step == last:
            save_checkpoint(args.work_dir, state, settings)
    tps = progress.tokens_per_second(state.step)
    print(f"trained to step {state.step}: {tps:.0f} tok/s", file=sys.stderr)
    return state, losses, tps


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run (or resume) training, evaluate, export; returns the metrics also saved as JSON."""
    args = parse_args(argv)
    began = time.monotonic()
    settings = {k: getattr(args, k) for k in RESULT_SETTINGS}
    args.work_dir.mkdir(parents=True, exist_ok=True)
    has_checkpoint = (args.work_dir / "train_state.json").is_file()
    if has_checkpoint and not args.resume:
        raise ValueError(f"{args.work_dir} already holds a checkpoint: pass --resume to "
                         "continue it, or choose another --work-dir")
    shape = ModelShape(**{k: getattr(args, k) for k in (
        "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
        "intermediate_size", "context")})
    spec = OptimizerSpec(peak_lr=args.peak_lr, final_lr=args.final_lr,
                         warmup_steps=args.warmup_steps, total_steps=args.steps,
                         weight_decay=args.weight_decay)
    tok_dir = args.work_dir / "tokenizer"
    train, heldout, heldout_names = _prepare_data(args, tok_dir, args.resume)
    print(f"data: {len(train)} train tokens, {len(heldout)} held-out tokens "
          f"({len(heldout_names)} files: {', '.join(heldout_names)})", file=sys.stderr)
    _, graphdef, abstract = build_model(shape)
    params = init_params(abstract, shape.num_layers, args.seed)
    state = TrainState(params=params, opt_state=make_optimizer(spec).init(params), step=0, cursor=0)
    if args.resume:
        state = load_checkpoint(args.work_dir, state, settings)
        print(f"resumed at step {state.step}", file=sys.stderr)
    sampler = WindowSampler(train, shape.context, args.seed)
    windows = eval_windows(heldout, shape.context)
    fns = _compile(graphdef, spec)
    state, losses, tps = _train_loop(args, state, sampler, fns,
                                     windows[:args.quick_eval_windows], settings,
                                     make_schedule(spec))
    heldout_loss = evaluate(fns[1], state.params, windows, args.batch_size)
    unigram = unigram_nll(train, windows[:, 1:], shape.vocab_size)
    export_hf(state.params, shape, tok_dir, args.out_dir)
    metrics = {
        "step": state.step, "train_losses_this_run": losses, "tokens_per_second": tps,
        "heldout_loss": heldout_loss,
        "heldout_ppl": math.exp(heldout_loss), "unigram_loss": unigram,
        "unigram_ppl": math.exp(unigram), "heldout_tokens_scored": int(windows[:, 1:].size),
        "train_tokens": len(train), "heldout_files": heldout_names,
        "num_params": int(sum(x.size for x in jax.tree_util.tree_leaves(state.params))),
        "run_seconds": time.monotonic() - began,
    }
    (args.work_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"held-out loss {heldout_loss:.4f} (ppl {metrics['heldout_ppl']:.2f}); unigram "
          f"ppl {metrics['unigram_ppl']:.2f}; exported to {args.out_dir}", file=sys.stderr)
    return metrics


if __name__ == "__main__":
    main()
