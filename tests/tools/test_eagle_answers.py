"""tools/eagle_answers.py: prompts rendered by the engine, answered by transformers,
give the chats the engine itself would produce."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from esurge import SamplingParams, eSurge
from tools.chat_prompts import chat_prompts
from tools.eagle_answers import Sequences, main, read_split
from tools.eagle_chat import chat_config


def test_sequences_keep_ragged_rows_through_a_file(tmp_path: Path) -> None:
    rows = [[5, 6, 7], [], [9]]
    seqs = Sequences(rows)
    np.savez(tmp_path / "s.npz", train_ids=seqs.ids, train_offsets=seqs.offsets)
    assert [r.tolist() for r in read_split(tmp_path / "s.npz", "train")] == rows


def test_answers_are_the_engines_greedy_chats(tmp_path: Path, tiny_llama_dir: Path) -> None:
    prompts, answers = tmp_path / "p.npz", tmp_path / "a.npz"
    assert main(["render", "--target", str(tiny_llama_dir), "--out", str(prompts)]) == 0
    rendered = read_split(prompts, "heldout")
    assert len(rendered) == len(chat_prompts("heldout"))
    with np.load(prompts) as data:
        assert data["stop_ids"].tolist() == [2]  # the template's end of turn, </s>
    assert main(["answer", "--target", str(tiny_llama_dir), "--prompts", str(prompts),
                 "--out", str(answers), "--train", "5", "--heldout", "2", "--batch", "3",
                 "--max-tokens", "24"]) == 0
    got = read_split(answers, "train") + read_split(answers, "heldout")
    asked = read_split(prompts, "train")[:5] + rendered[:2]
    with eSurge(tiny_llama_dir, chat_config(256), show_progress=False, warmup=False) as llm:
        outs = llm.generate([p.tolist() for p in asked],
                            SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[2]))
    for chat, out in zip(got, outs, strict=True):
        assert chat.tolist() == [*out.prompt_token_ids, *out.outputs[0].token_ids]
