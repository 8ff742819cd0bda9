"""Session fixtures shared by every test area."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

_LAYOUTS = pytest.StashKey[str]()
_CONFIGS = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    # The serving layouts and GGUF config records the tests' loads store
    # (esurge.models.layout_cache, esurge.models.config_record) go to
    # directories of this run's own, removed at its end: a test run neither
    # fills nor evicts the user's caches. Servers the tests start inherit them.
    if "ESURGE_LAYOUT_CACHE" not in os.environ:
        config.stash[_LAYOUTS] = tempfile.mkdtemp(prefix="esurge-test-layouts-")
        os.environ["ESURGE_LAYOUT_CACHE"] = config.stash[_LAYOUTS]
    if "ESURGE_CONFIG_CACHE" not in os.environ:
        config.stash[_CONFIGS] = tempfile.mkdtemp(prefix="esurge-test-configs-")
        os.environ["ESURGE_CONFIG_CACHE"] = config.stash[_CONFIGS]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _LAYOUTS in config.stash:
        from esurge.models.layout_cache import wait_for_writes

        wait_for_writes()
        shutil.rmtree(config.stash[_LAYOUTS], ignore_errors=True)
    if _CONFIGS in config.stash:
        shutil.rmtree(config.stash[_CONFIGS], ignore_errors=True)


# The tensor-parallel tests need 8 (simulated) devices, a count fixed when the
# backend starts: `make test` runs them in a process of their own with
# PARALLEL_XLA_FLAGS (see the Makefile). This process leaves them out.
PARALLEL_XLA_FLAGS = "--xla_force_host_platform_device_count=8"
if PARALLEL_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    collect_ignore = ["parallel"]


# Each turn is "<s>role\ncontent</s>\n"; the reply opens with "<s>assistant\n".
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 512-token byte-level BPE tokenizer trained here on standard-library source."""
    from tools.tokenizer_training import stdlib_texts, train_bpe_tokenizer

    out = tmp_path_factory.mktemp("tiny_tokenizer")
    train_bpe_tokenizer(stdlib_texts(max_files=40), vocab_size=512, out_dir=out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """A random 2-layer Llama (hidden 64, GQA 4/2, vocab 512) with the tiny tokenizer
    and a ChatML-like chat template (TINY_CHAT_TEMPLATE).

    Token ids: 0 <pad>, 1 <s> (bos), 2 </s> (eos, the end of a turn).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    shutil.copy(tiny_tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    settings = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text())
    settings["chat_template"] = TINY_CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    return out
