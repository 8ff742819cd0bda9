"""tools/eagle_answers.py: prompts rendered by the engine, answered by transformers,
give the chats the engine itself would produce."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from esurge import SamplingParams, eSurge
from tools.chat_prompts import chat_prompts
from tools.eagle_answers import flat_split, main, read_split
from tools.eagle_chat import chat_config
from tools.train_eagle import main as train_main

REPO = Path(__file__).resolve().parents[2]


def test_sequences_keep_ragged_rows_through_a_file(tmp_path: Path) -> None:
    rows = [[5, 6, 7], [], [9]]
    np.savez(tmp_path / "s.npz", **flat_split("train", rows))
    assert [r.tolist() for r in read_split(tmp_path / "s.npz", "train")] == rows


@pytest.fixture(scope="module")
def answered(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path
             ) -> tuple[Path, Path]:
    """(rendered prompts, answers to 5 train and 2 held-out ones) of the tiny chat model."""
    out = tmp_path_factory.mktemp("answers")
    prompts, answers = out / "p.npz", out / "a.npz"
    assert main(["render", "--target", str(tiny_llama_dir), "--out", str(prompts)]) == 0
    assert main(["answer", "--target", str(tiny_llama_dir), "--prompts", str(prompts),
                 "--out", str(answers), "--train", "5", "--heldout", "2", "--batch", "3",
                 "--max-tokens", "24"]) == 0
    return prompts, answers


def test_answers_are_the_engines_greedy_chats(answered: tuple[Path, Path],
                                              tiny_llama_dir: Path) -> None:
    prompts, answers = answered
    rendered = read_split(prompts, "heldout")
    assert len(rendered) == len(chat_prompts("heldout"))
    with np.load(prompts) as data:
        assert data["stop_ids"].tolist() == [2]  # the template's end of turn, </s>
    got = read_split(answers, "train") + read_split(answers, "heldout")
    asked = read_split(prompts, "train")[:5] + rendered[:2]
    with eSurge(tiny_llama_dir, chat_config(256), show_progress=False, warmup=False) as llm:
        outs = llm.generate([p.tolist() for p in asked],
                            SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[2]))
    for chat, out in zip(got, outs, strict=True):
        assert chat.tolist() == [*out.prompt_token_ids, *out.outputs[0].token_ids]


@pytest.fixture(scope="module")
def chat_stdlib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 4-layer test model (an EAGLE-3 head fuses 3 of its layers) with the tiny
    chat template."""
    from tests.conftest import TINY_CHAT_TEMPLATE

    out = tmp_path_factory.mktemp("chat_stdlib") / "model"
    shutil.copytree(REPO / "models" / "tiny-stdlib", out)
    settings = json.loads((out / "tokenizer_config.json").read_text())
    settings["chat_template"] = TINY_CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    return out


def test_a_head_trains_on_answers_and_scores_their_held_out_chats(
        chat_stdlib: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts, answers, head = tmp_path / "p.npz", tmp_path / "a.npz", tmp_path / "head"
    assert main(["render", "--target", str(chat_stdlib), "--out", str(prompts)]) == 0
    assert main(["answer", "--target", str(chat_stdlib), "--prompts", str(prompts),
                 "--out", str(answers), "--train", "4", "--heldout", "2", "--batch", "3",
                 "--max-tokens", "16"]) == 0
    assert train_main(["--target", str(chat_stdlib), "--out", str(head), "--chat",
                       "--answers", str(answers), "--distill-prompts", "4", "--aux-layers", "2,3,4",
                       "--draft-vocab", "64", "--context", "128", "--batch-size", "2",
                       "--unroll", "2", "--steps", "4", "--max-train-seconds", "0"]) == 0
    assert "read 4 train chats" in capsys.readouterr().err  # not answered by the engine
    info = json.loads((head / "training_info.json").read_text())
    assert info["steps"] == 1  # --max-train-seconds 0 stops after the first step
    accuracy = info["heldout_draft_accuracy"]
    assert len(accuracy) == 2 and all(0.0 <= a <= 1.0 for a in accuracy)
    assert (head / "model.safetensors").is_file()
