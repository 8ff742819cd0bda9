"""Where a model's config, tokenizer and tensors come from: an HF directory or a GGUF file.

`open_checkpoint(path)` picks the source by what the path is. Both sources
answer the same questions (the HF config, the EOS ids, each parameter by its
HF name), so the loader builds the model the same way from either; neither
ever runs remote code or unpickles anything.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from safetensors import safe_open

from esurge.models.gguf_file import GGUFCheckpoint
from esurge.models.weight_codes import WeightCodes

__all__ = [
    "CheckpointSource",
    "GGUFSource",
    "HFDirectorySource",
    "MissingTensorError",
    "hf_tokenizer_of",
    "open_checkpoint",
]


class MissingTensorError(ValueError):
    """The checkpoint lacks a parameter the model needs (`name`)."""

    def __init__(self, path: Path, name: str) -> None:
        self.path, self.name = path, name
        super().__init__(f"checkpoint {path} is missing tensor {name!r}")


class CheckpointSource(Protocol):
    """A checkpoint the loader can build a model from."""

    path: Path
    kind: str  # "safetensors" or "gguf", for logs and GetModelInfo

    def hf_config(self) -> Any:
        """The transformers config of the model."""
        ...

    def eos_token_ids(self, hf_config: Any) -> tuple[int, ...]:
        """Tokens that end generation, the primary EOS first."""
        ...

    def stored_precision(self, hf_config: Any) -> str:
        """How the weights are stored: "float32", "bfloat16", ..., or "quantized"."""
        ...

    def read(self, name: str) -> np.ndarray:
        """The parameter `name` (HF naming); MissingTensorError if absent."""
        ...

    def read_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """A slice of the parameter `name` (index: one slice per leading axis)."""
        ...

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The shape of the parameter `name`; MissingTensorError if absent."""
        ...

    def read_codes(self, name: str) -> WeightCodes | None:
        """The linear weight `name` as affine codes, where the checkpoint stores
        it in such a block format (esurge.models.weight_codes); else None."""
        ...

    def stores_bfloat16(self, name: str) -> bool:
        """True when the checkpoint stores the parameter `name` in bfloat16 (its
        values then widen exactly from two bytes each); read from headers only."""
        ...

    def tokenizer(self) -> Any | None:
        """The checkpoint's transformers tokenizer (chat template included), if it has one."""
        ...

    def close(self) -> None:
        """Release open files."""
        ...


def _config_eos(hf_config: Any) -> list[Any]:
    return [getattr(hf_config, "eos_token_id", None)]


def _unique_ints(sources: list[Any]) -> tuple[int, ...]:
    found: list[int] = []
    for value in sources:
        for token in (value if isinstance(value, list) else [value]):
            if isinstance(token, int) and token not in found:
                found.append(token)
    return tuple(found)


def _has_chat_template(directory: Path) -> bool:
    if (directory / "chat_template.jinja").is_file() or (
            directory / "chat_template.json").is_file():
        return True
    config = directory / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def hf_tokenizer_of(directory: Path) -> Any | None:
    """The transformers tokenizer of a directory holding tokenizer.json.

    Only the chat template needs transformers' tokenizer; the engine encodes
    with the directory's tokenizer.json as it is (esurge.engine.api), so a
    directory without a template needs no transformers tokenizer at all.
    """
    if not (directory / "tokenizer.json").is_file() or not _has_chat_template(directory):
        return None
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(directory))


class HFDirectorySource:
    """A Hugging Face checkpoint directory: config.json and safetensors shards."""

    kind = "safetensors"

    def stored_precision(self, hf_config: Any) -> str:
        text = getattr(hf_config, "text_config", None) or hf_config
        stored = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None)
        return str(stored or "float32").removeprefix("torch.")

    def __init__(self, path: Path) -> None:
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json")
        self.path = path
        self._files = self._tensor_files()
        self._handles: dict[Path, Any] = {}

    def _tensor_files(self) -> dict[str, Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
            files = {name: self.path / file for name, file in weight_map.items()}
            for file in set(files.values()):
                if not file.is_file():
                    raise ValueError(f"{index} names {file.name}, which does not exist")
            return files
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise ValueError(f"no *.safetensors files in {self.path} (pickled .bin checkpoints "
                             "are not supported)")
        files = {}
        for shard in shards:
            with safe_open(str(shard), framework="numpy") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    files.setdefault(name, shard)
        return files

    def hf_config(self) -> Any:
        from transformers import AutoConfig  # heavy import, only needed here

        return AutoConfig.from_pretrained(str(self.path), trust_remote_code=False)

    def eos_token_ids(self, hf_config: Any) -> tuple[int, ...]:
        sources = _config_eos(hf_config)
        generation = self.path / "generation_config.json"
        if generation.is_file():
            sources.append(json.loads(generation.read_text()).get("eos_token_id"))
        return _unique_ints(sources)

    def read(self, name: str) -> np.ndarray:
        file = self._files.get(name)
        if file is None:
            raise MissingTensorError(self.path, name)
        if file not in self._handles:
            # "flax" keeps bfloat16 tensors (numpy has no bfloat16 of its own).
            self._handles[file] = safe_open(str(file), framework="flax")
        return np.asarray(self._handles[file].get_tensor(name))

    def _handle(self, name: str) -> Any:
        file = self._files.get(name)
        if file is None:
            raise MissingTensorError(self.path, name)
        if file not in self._handles:
            # "flax" keeps bfloat16 tensors (numpy has no bfloat16 of its own).
            self._handles[file] = safe_open(str(file), framework="flax")
        return self._handles[file]

    def read_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if not index:
            return self.read(name)
        # Only the slice's bytes are read from the file.
        return np.asarray(self._handle(name).get_slice(name)[index])

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read_codes(self, name: str) -> WeightCodes | None:
        return None  # safetensors hold plain floats

    def stores_bfloat16(self, name: str) -> bool:
        return str(self._handle(name).get_slice(name).get_dtype()).upper() == "BF16"

    def tokenizer(self) -> Any | None:
        return hf_tokenizer_of(self.path)

    def close(self) -> None:
        self._handles.clear()


# GGUF files opened with keep_open=True, by (path, size, mtime): reading a
# GGUF's metadata takes seconds (the gguf reader walks every vocabulary
# entry), so a caller that looked at it first (the CLI, for the context
# length) hands the open file to the loader instead of it being read twice.
_KEPT_OPEN: dict[tuple[str, int, int], GGUFCheckpoint] = {}


def _num_layers_of(hf_config: Any) -> int:
    text = getattr(hf_config, "text_config", None) or hf_config
    return int(text.num_hidden_layers)


def _file_key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


class GGUFSource:
    """A single GGUF file (see esurge.models.gguf_file)."""

    kind = "gguf"

    def __init__(self, path: Path, keep_open: bool = False) -> None:
        self.path = path
        key = _file_key(path)
        kept = _KEPT_OPEN.pop(key, None)
        self.gguf = kept if kept is not None else GGUFCheckpoint(path)
        if keep_open:
            _KEPT_OPEN[key] = self.gguf
        self._read: Any = None
        self._codes: Any = None
        self._num_layers: int | None = None
        self._last: tuple[str, np.ndarray] | None = None

    def hf_config(self) -> Any:
        config = self.gguf.hf_config()
        self._num_layers = _num_layers_of(config)
        return config

    def _layers(self) -> int:
        if self._num_layers is None:
            return _num_layers_of(self.hf_config())
        return self._num_layers

    def eos_token_ids(self, hf_config: Any) -> tuple[int, ...]:
        return _unique_ints([*_config_eos(hf_config), *self.gguf.end_of_turn_ids])

    def stored_precision(self, hf_config: Any) -> str:
        types = set(self.gguf.tensor_types) - {"F32"}
        if types - {"F16", "BF16"}:
            return "quantized"
        if "BF16" in types:
            return "bfloat16"
        return "float16" if types else "float32"

    def read(self, name: str) -> np.ndarray:
        # Made on first use: a load whose layout comes from the layout cache
        # reads no tensor, and the reader's transformers processors import torch.
        if self._read is None:
            self._read = self.gguf.tensor_reader(self._layers())
        try:
            return self._read(name)  # type: ignore[no-any-return]
        except KeyError:
            raise MissingTensorError(self.path, name) from None

    def read_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        # GGUF tensors are dequantized whole; the last one is kept, since every
        # device's slice of it is asked for in turn.
        return self._whole(name)[index]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._whole(name).shape)

    def _whole(self, name: str) -> np.ndarray:
        if self._last is None or self._last[0] != name:
            self._last = (name, self.read(name))
        return self._last[1]

    def read_codes(self, name: str) -> WeightCodes | None:
        if self._codes is None:
            self._codes = self.gguf.code_reader(self._layers())
        try:
            return self._codes(name)  # type: ignore[no-any-return]
        except KeyError:
            raise MissingTensorError(self.path, name) from None

    def stores_bfloat16(self, name: str) -> bool:
        # A GGUF's float tensors go through its own reader (its names differ
        # from HF's): they serve as float32 panels, not widened ones.
        return False

    def tokenizer(self) -> Any | None:
        tokenizer = self.gguf.tokenizer()
        return None if tokenizer is None else tokenizer.hf_tokenizer

    def close(self) -> None:
        self._read = None
        self._codes = None
        self._last = None


def open_checkpoint(path: str | Path, *, keep_open: bool = False) -> CheckpointSource:
    """The source at `path`: a `.gguf` file or an HF checkpoint directory.

    keep_open: a GGUF stays open for the next open_checkpoint of the same
    file (which takes it over), so its metadata is not read twice.
    """
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return GGUFSource(p, keep_open)
    if p.is_dir():
        return HFDirectorySource(p)
    raise ValueError(f"{p} is neither a Hugging Face checkpoint directory nor a .gguf file")
