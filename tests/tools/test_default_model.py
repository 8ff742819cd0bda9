"""The shipped default model (models/tiny-stdlib): loadable by transformers and by our
engine, identical greedy tokens on both, and a real (if small) Python model."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from esurge import CacheConfig, Config, SamplingParams, SchedulerConfig, eSurge
from esurge.models import cpu_kernels, load_model
from tests.models.paged import PagedSession, Row, hf_logits
from tools.lm_data import HELDOUT_EVERY, HELDOUT_OFFSET
from tools.tokenizer_training import stdlib_files

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-stdlib"
PROMPTS = ["def main():\n", "import os\nimport sys\n\n", "class Point:\n    def __init__(self",
           "    for i in range(len(items)):\n"]
NEW_TOKENS = 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos on our side
    return model


@pytest.fixture(scope="module")
def engine() -> Iterator[eSurge]:
    config = Config(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                        chunked_prefill_enabled=True, max_num_seq_buckets=(4,)),
        CacheConfig(num_pages=64, page_size=16, enable_prefix_caching=True),
    )
    with eSurge(MODEL_DIR, config, dtype="float32", show_progress=False) as llm:
        yield llm


def test_checkpoint_layout() -> None:
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    assert config["vocab_size"] == 4096 and config["max_position_embeddings"] == 512
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 25 * 2**20
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    from safetensors import safe_open

    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as handle:
        dtypes = {handle.get_tensor(name).dtype for name in handle.keys()}  # noqa: SIM118
    assert dtypes == {torch.bfloat16}


def test_tokenizer_loads_in_transformers(tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(MODEL_DIR)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert hf.get_vocab() == tokenizer.get_vocab()
    for text in PROMPTS:
        ids = hf(text)["input_ids"]
        assert ids == tokenizer.encode(text).ids
        assert hf.decode(ids) == text


def test_our_logits_match_transformers(hf_model: Any, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n").ids[:24]
    want = hf_logits(hf_model, ids)
    (got,) = PagedSession(load_model(MODEL_DIR, "float32")).step(
        [Row("a", ids, 0, num_logits=len(ids))])
    assert np.ptp(want) > 5.0
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


def test_engine_greedy_tokens_equal_transformers(engine: eSurge, hf_model: Any,
                                                 tokenizer: Tokenizer) -> None:
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                   ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tokenizer.encode(prompt).ids
        with torch.no_grad():
            gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                    do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == gen[0, len(ids):].tolist()


def test_completions_look_like_python(engine: eSurge) -> None:
    prompts = ["    def __repr__(self", "class Point:\n    def __init__(self, x, y):\n        self"]
    method, attribute = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    # The signature is closed, and the body is indented deeper and returns something.
    assert method.outputs[0].text.startswith("):\n        ")
    assert "return " in method.outputs[0].text
    assert attribute.outputs[0].text.startswith(".")


def test_heldout_perplexity_is_low(hf_model: Any, tokenizer: Tokenizer) -> None:
    """On a held-out file the model does far better than a unigram model (ppl ~800 on the
    held-out split; the model scores ~144 on the whole split)."""
    held = [p for i, p in enumerate(stdlib_files()) if i % HELDOUT_EVERY == HELDOUT_OFFSET]
    text = next(p for p in held if p.name == "textwrap.py").read_text()
    ids = tokenizer.encode(text).ids[:513]  # one full context
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids[:-1]])).logits[0]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item()
    assert math.exp(nll) < 300


def test_auto_dtype_of_the_bfloat16_checkpoint_on_cpu() -> None:
    # Native bfloat16 where the CPU multiplies it (AVX512_BF16), else float32.
    loaded = load_model(MODEL_DIR, fuse=False)
    if cpu_kernels.kernels_serve("bfloat16"):
        assert loaded.dtype == "bfloat16"
        assert loaded.dtype_reason.startswith("bfloat16 checkpoint; this CPU's native")
    else:
        assert loaded.dtype == "float32"
        assert loaded.dtype_reason.startswith("bfloat16 checkpoint upcast")
