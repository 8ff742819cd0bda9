"""The served model's tokenizer files as one zip, for gateways that tokenize
themselves (vLLM protocol's GetTokenizer: smg then needs no local model path).

An HF directory's own files go in as they are; a GGUF file carries its
tokenizer in its metadata, so transformers' rebuilt tokenizer is saved
(tokenizer.json, tokenizer_config.json with the chat template) beside the
model's config.json. Built once, in a worker thread, and kept in memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from esurge.engine.api import eSurge

__all__ = ["CHUNK_BYTES", "TokenizerBundle"]

CHUNK_BYTES = 64 * 1024
_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
          "generation_config.json", "chat_template.json", "chat_template.jinja",
          "vocab.json", "merges.txt", "tokenizer.model")


def _zip_dir(directory: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in _FILES:
            if (directory / name).is_file():
                archive.write(directory / name, name)
    return buf.getvalue()


def build_bundle(engine: eSurge) -> bytes:
    """The zip's bytes; FileNotFoundError when the model has no tokenizer."""
    model = engine.model
    if model.source_kind != "gguf" and (model.model_dir / "tokenizer.json").is_file():
        return _zip_dir(model.model_dir)
    if model.hf_tokenizer is None:
        raise FileNotFoundError(f"the model at {model.model_dir} has no tokenizer to hand out")
    with tempfile.TemporaryDirectory(prefix="esurge-tokenizer-") as tmp:
        out = Path(tmp)
        model.hf_tokenizer.save_pretrained(str(out))
        (out / "config.json").write_text(model.hf_config.to_json_string())
        return _zip_dir(out)


class TokenizerBundle:
    """The zip and its sha256, built on first use."""

    def __init__(self, engine: eSurge) -> None:
        self._engine = engine
        self._built: tuple[bytes, str] | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> tuple[bytes, str]:
        """(zip bytes, sha256 hex) of the served tokenizer."""
        async with self._lock:
            if self._built is None:
                data = await asyncio.to_thread(build_bundle, self._engine)
                self._built = data, hashlib.sha256(data).hexdigest()
        return self._built
