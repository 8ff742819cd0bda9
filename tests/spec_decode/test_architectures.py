"""With random Eagle heads (drafts nearly always rejected), greedy output through
the speculative engine is token-identical to transformers' greedy generate (which
tests/engine shows the plain engine matches) on every supported architecture, for
a batch of mixed lengths, both head layouts and k in {1, 3, 5}."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from esurge import SamplingParams, eSurge
from esurge.spec_decode.config import EagleLayout
from tests.models.checkpoints import build_model, hf_config, save_checkpoint
from tests.spec_decode.helpers import random_head, spec_config

NEW_TOKENS = 16
CASES = [  # family, layout, k, target layers (EAGLE-3 fuses three distinct layers)
    ("llama", EagleLayout.EAGLE3, 1, 4),
    ("mistral", EagleLayout.EAGLE1, 3, 2),
    ("qwen2", EagleLayout.EAGLE1, 5, 2),
    ("qwen3", EagleLayout.EAGLE3, 3, 4),
    ("gemma2", EagleLayout.EAGLE1, 1, 3),
    ("gemma3", EagleLayout.EAGLE1, 5, 2),
]


def prompts(vocab: int = 256, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(n)).tolist() for n in np.linspace(3, 44, 6)]


@pytest.mark.parametrize(("family", "layout", "k", "layers"), CASES,
                         ids=[f"{c[0]}-{c[1].value}-k{c[2]}" for c in CASES])
def test_random_head_keeps_greedy_tokens(family: str, layout: EagleLayout, k: int, layers: int,
                                         tmp_path: Path) -> None:
    overrides: dict[str, object] = {"num_hidden_layers": layers}
    if family == "gemma3":
        overrides["layer_types"] = ["sliding_attention", "full_attention"]
    model = build_model(hf_config(family, **overrides), seed=1)
    target = save_checkpoint(model, tmp_path / family)
    aux = (1, 2, 3) if layout is EagleLayout.EAGLE3 else None
    head = random_head(target, tmp_path / "head", layout, seed=2, aux_layer_ids=aux,
                       draft_vocab_size=200 if layout is EagleLayout.EAGLE3 else None)
    batch = prompts()
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS,
                                   do_sample=False)[0, len(p):].tolist() for p in batch]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with eSurge(target, spec_config(k, head), show_progress=False, warmup=False,
                speculation="always", min_token_bucket=32) as llm:
        outs = llm.generate(batch, params)
        stats = llm.runner.spec_stats
    assert [o.outputs[0].token_ids for o in outs] == expected
    # Speculation really ran: every request after its prefill verified drafts.
    assert stats is not None and stats.num_draft_tokens > 0
    assert all(o.outputs[0].num_draft_tokens > 0 for o in outs)
