"""The chat prompts an Eagle head for a chat model trains and is evaluated on."""

from __future__ import annotations

import pytest

from tools.chat_prompts import TASKS, TOPICS, chat_prompts


def test_held_out_prompts_ask_about_topics_never_trained_on() -> None:
    train, heldout = chat_prompts("train"), chat_prompts("heldout")
    assert len(train) + len(heldout) == len(TOPICS) * len(TASKS)
    assert len(heldout) == len(TOPICS) // 5 * len(TASKS)
    held_topics = {t for i, t in enumerate(TOPICS) if i % 5 == 4}
    assert all(any(t in p for t in held_topics) for p in heldout)
    assert not any(t in p for t in held_topics for p in train)
    assert chat_prompts("train") == train  # deterministic


def test_an_unknown_split_is_refused() -> None:
    with pytest.raises(ValueError, match="split"):
        chat_prompts("test")
