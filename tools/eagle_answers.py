"""A chat model's greedy answers to the chat prompts, made in bulk on a GPU.

tools/train_eagle.py --chat answers its training prompts through the engine,
which on a CPU bounds the data to about a thousand chats an hour. This tool
splits the work so the answers can come from elsewhere:

    # here, on the CPU: the prompts rendered exactly as the engine renders them
    .venv/bin/python tools/eagle_answers.py render --target T.gguf --out P.npz
    # where a GPU is (PyTorch and transformers' GGUF loading): greedy answers
    python3 tools/eagle_answers.py answer --target T.gguf --prompts P.npz --out A.npz
    # then: tools/train_eagle.py --chat --answers A.npz ...

The prompts are token ids rendered by the engine's own chat template path
(esurge's InputProcessor), so the answering side needs no tokenizer, and
answers end at the engine's end-of-turn tokens, which they include, as the
engine's outputs do. The answers are those of transformers' float32 model
of the same GGUF weights: greedy picks agree with the engine's except at
near-ties, which changes no label's meaning for a draft head.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

__all__ = ["flat_split", "main", "read_split"]

SPLITS = ("train", "heldout")


def flat_split(split: str, seqs: Sequence[Sequence[int] | np.ndarray]
               ) -> dict[str, np.ndarray]:
    """A split's variable-length sequences kept flat: `{split}_ids` (all tokens)
    and `{split}_offsets` ([N + 1], where each sequence starts and the last ends)."""
    offsets = np.cumsum([0, *map(len, seqs)]).astype(np.int64)
    ids = np.concatenate([np.asarray(s, np.int32) for s in seqs]) if seqs else np.zeros(0)
    return {f"{split}_ids": ids.astype(np.int32), f"{split}_offsets": offsets}


def read_split(path: Path, split: str) -> list[np.ndarray]:
    """One split ("train" or "heldout") of a render or answer file."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    with np.load(path) as data:
        return np.split(data[f"{split}_ids"], data[f"{split}_offsets"][1:-1])


def render(args: argparse.Namespace) -> None:
    """Token ids of every train and held-out chat prompt, and the stop tokens."""
    from esurge import SamplingParams, eSurge
    from esurge.engine.chat import ChatMessage, ChatPrompt
    from tools.chat_prompts import chat_prompts
    from tools.eagle_chat import chat_config

    arrays: dict[str, np.ndarray] = {}
    with eSurge(args.target, chat_config(256), show_progress=False, warmup=False) as llm:
        params = SamplingParams(temperature=0, max_tokens=1)
        for split in SPLITS:
            prepared = [llm.inputs.prepare(f"{split}-{i}", ChatPrompt((ChatMessage("user", p),)),
                                           params)
                        for i, p in enumerate(chat_prompts(split))]
            arrays |= flat_split(split, [p.prompt_token_ids for p in prepared])
        # Every chat request gets the same stops: the template's end of turn.
        stops = {*prepared[0].params.stop_token_ids, *llm.model.eos_token_ids}
    arrays["stop_ids"] = np.asarray(sorted(stops), np.int32)
    np.savez(args.out, **arrays)  # type: ignore[arg-type]
    print(f"rendered {len(arrays['train_offsets']) - 1} train and "
          f"{len(arrays['heldout_offsets']) - 1} held-out prompts; stop ids "
          f"{arrays['stop_ids'].tolist()}", file=sys.stderr)


def _answer_batch(model: Any, prompts: list[np.ndarray], stop_ids: list[int],
                  max_tokens: int, device: str) -> list[np.ndarray]:
    """Greedy answers (prompt + answer, through the first stop token) of one batch."""
    import torch

    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: every answer starts at `width`
        ids[i, width - len(p):] = torch.as_tensor(p.astype(np.int64))
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             do_sample=False, max_new_tokens=max_tokens,
                             eos_token_id=stop_ids, pad_token_id=stop_ids[0])
    answers = out[:, width:].cpu().numpy()
    result = []
    for p, a in zip(prompts, answers, strict=True):
        ends = np.flatnonzero(np.isin(a, stop_ids))
        a = a[:ends[0] + 1] if len(ends) else a
        result.append(np.concatenate([p, a.astype(np.int32)]))
    return result


def answer(args: argparse.Namespace) -> None:
    """Greedy answers to the first --train and --heldout prompts, with transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 like the engine's features
    began = time.monotonic()
    source = ({"pretrained_model_name_or_path": args.target} if args.target.is_dir() else
              {"pretrained_model_name_or_path": args.target.parent, "gguf_file": args.target.name})
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32).to(device).eval()
    with np.load(args.prompts) as data:
        stop_ids = [int(t) for t in data["stop_ids"]]
    arrays: dict[str, np.ndarray] = {}
    for split, count in (("train", args.train), ("heldout", args.heldout)):
        prompts = read_split(args.prompts, split)[:count]
        # Similar lengths together: less padding per batch.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        done: dict[int, np.ndarray] = {}
        for start in range(0, len(order), args.batch):
            pick = order[start:start + args.batch]
            for i, seq in zip(pick, _answer_batch(model, [prompts[i] for i in pick], stop_ids,
                                                  args.max_tokens, device), strict=True):
                done[i] = seq
            print(f"{split}: {len(done)}/{len(prompts)} answered, "
                  f"{time.monotonic() - began:.0f}s", file=sys.stderr, flush=True)
        arrays |= flat_split(split, [done[i] for i in range(len(prompts))])
    np.savez(args.out, **arrays)  # type: ignore[arg-type]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="the chat prompts as the engine's token ids")
    r.add_argument("--target", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    a = sub.add_parser("answer", help="greedy answers with transformers (a GPU if present)")
    a.add_argument("--target", type=Path, required=True,
                   help="the model: a .gguf file or an HF directory")
    a.add_argument("--prompts", type=Path, required=True, help="a `render` output")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--train", type=int, default=None,
                   help="answer the first N train prompts (default: all)")
    a.add_argument("--heldout", type=int, default=0, help="and the first N held-out ones")
    a.add_argument("--max-tokens", type=int, default=208)
    a.add_argument("--batch", type=int, default=256)
    args = p.parse_args(argv)
    lowest = {"train": 1, "heldout": 0, "max_tokens": 1, "batch": 1}
    for name, low in lowest.items():
        value = getattr(args, name, None)
        if args.command == "answer" and value is not None and value < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen step."""
    args = parse_args(argv)
    (render if args.command == "render" else answer)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
