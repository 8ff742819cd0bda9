"""Train a byte-level BPE tokenizer on local text and save it in Hugging Face layout.

Used by the tests (tiny tokenizers) and by the default-model training script.
The corpus every machine has is the Python standard library's own source.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = ["BOS", "EOS", "stdlib_files", "stdlib_texts", "train_bpe_tokenizer"]

BOS = "<s>"
EOS = "</s>"
PAD = "<pad>"


def stdlib_files() -> list[Path]:
    """The standard library's top-level *.py files, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def stdlib_texts(max_files: int | None = None, skip: int = 0) -> Iterator[str]:
    """Source files of the standard library in a stable order."""
    files = stdlib_files()[skip:]
    for path in files[:max_files] if max_files is not None else files:
        yield path.read_text(encoding="utf-8", errors="replace")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path, *,
                        isolate_newlines: bool = False) -> Tokenizer:
    """Train, then write tokenizer.json and tokenizer_config.json into out_dir.

    isolate_newlines: make every "\n" its own token. Byte-level BPE otherwise
    merges a newline with the next line's indentation, so a prompt that ends
    at a line break ends on a token that in training only precedes unindented
    lines.
    """
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Split("\n", behavior="isolated"), byte_level])
        if isolate_newlines else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": 1 << 20,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok
