"""eSurge.generate is token-identical to transformers' greedy generate on every
supported architecture, for a 16-prompt batch of mixed lengths, with plain
steps and with decode bursts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from esurge import SamplingParams, eSurge
from tests.engine.conftest import engine_config, mixed_prompts
from tests.models.checkpoints import build_model, hf_config, save_checkpoint

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")
VOCAB = 256  # tests/models/checkpoints.py's tiny vocabulary
NEW_TOKENS = 24


@pytest.mark.parametrize("decode_steps", [1, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_matches_transformers(family: str, decode_steps: int, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = build_model(hf_config(family), seed=1)
    path = save_checkpoint(model, tmp_path / family)
    prompts = mixed_prompts(vocab=VOCAB, seed=3)
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False)
            expected.append(out[0, len(prompt):].tolist())
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with eSurge(path, engine_config(), show_progress=False, decode_steps=decode_steps) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        bursts = llm.scheduler.num_decode_bursts
    assert got == expected
    assert (bursts > 0) == (decode_steps > 1)
