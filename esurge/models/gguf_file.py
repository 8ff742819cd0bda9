"""A single GGUF file as a checkpoint: config, tokenizer and dequantized tensors.

llama.cpp's format keeps everything in one file: the model's hyper-parameters
and tokenizer as metadata under llama.cpp's key names, and every tensor in
ggml's (possibly quantized) block formats. Nothing here re-implements that
format: the `gguf` package (llama.cpp's own reader, name map and numpy
dequantizers) reads it, and transformers' GGUF tables turn the metadata into
a Hugging Face config and tokenizer and undo llama.cpp's tensor rewrites
(Llama's q/k row permutation, Gemma's norm offset). Those transformers
helpers are the torch-free ones, so serving a GGUF needs no torch.

Tensors are memory-mapped and dequantized one at a time, so the host holds
one dequantized tensor (plus the mapping) at once, not the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from esurge.models.config_record import config_for_model
from esurge.models.weight_codes import WeightCodes, weight_codes

__all__ = [
    "GGUF_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "GGUFCheckpoint",
    "GGUFTokenizer",
    "UnsupportedGGUFError",
]


class UnsupportedGGUFError(ValueError):
    """A GGUF file uses something the engine cannot load.

    `what` names the kind of thing ("architecture", "tensor type",
    "tokenizer") and `value` the offending value, so callers need not parse
    the message.
    """

    def __init__(self, path: Path, what: str, value: str, supported: tuple[str, ...]) -> None:
        self.path, self.what, self.value, self.supported = path, what, value, supported
        super().__init__(f"{path}: unsupported GGUF {what} {value!r}; supported: "
                         f"{', '.join(supported)}")


@dataclass(frozen=True, slots=True)
class _Family:
    model_type: str  # transformers' model_type
    architecture: str  # the HF class name our registry knows


# llama.cpp's `general.architecture` -> what transformers calls it. llama.cpp
# writes Mistral checkpoints as "llama"; transformers tells them apart by
# name, and so do we (see _family).
GGUF_ARCHITECTURES: dict[str, _Family] = {
    "llama": _Family("llama", "LlamaForCausalLM"),
    "mistral": _Family("mistral", "MistralForCausalLM"),
    "qwen2": _Family("qwen2", "Qwen2ForCausalLM"),
    "qwen3": _Family("qwen3", "Qwen3ForCausalLM"),
    "gemma2": _Family("gemma2", "Gemma2ForCausalLM"),
    "gemma3": _Family("gemma3_text", "Gemma3ForCausalLM"),
}

# ggml types whose numpy dequantizers we serve (others exist in the wild:
# they are refused by name rather than dequantized by an untested path).
SUPPORTED_TENSOR_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
)

# Metadata transformers' GGUF table leaves out although llama.cpp writes it and
# it changes the model: per-head width (Qwen 3 and Gemma give it explicitly;
# transformers would fall back to a config default) and Gemma 2's soft caps.
_EXTRA_CONFIG_KEYS: dict[str, dict[str, str]] = {
    "qwen3": {"attention.key_length": "head_dim"},
    "qwen2": {"attention.key_length": "head_dim"},
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "gemma3": {"final_logit_softcapping": "final_logit_softcapping"},
}


@dataclass(frozen=True, slots=True)
class GGUFTokenizer:
    """The tokenizer a GGUF describes, as transformers rebuilds it."""

    hf_tokenizer: Any  # transformers.PreTrainedTokenizerFast, with the file's chat template

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` the engine encodes and decodes with."""
        return self.hf_tokenizer.backend_tokenizer


def _plain_reader(path: Path) -> Any:
    """gguf's GGUFReader over a plain-ndarray view of its memory map.

    The reader slices its buffer once per metadata value; slicing an
    np.memmap makes a memmap object each time (a Python __array_finalize__
    per slice), which turned reading a 49k-token vocabulary into ~4 s of
    overhead (~1 s over a plain view). The view keeps the map alive.

    Arrays of strings and of scalars (a vocabulary, its merges and token
    types: ~150k items) are also split in one pass each rather than one
    generic recursive call per item, into the same parts (SmolLM2's file:
    0.25 s against 6.2 s for gguf's own reader, on a busy 2-core machine).
    """
    from gguf import GGUFReader, GGUFValueType

    class PlainArrayReader(GGUFReader):
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain  # type: ignore[no-any-return]

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            length = self._get(orig_offs + 4, np.uint64)
            item_type = GGUFValueType(int(raw_itype[0]))
            scalar = self.gguf_scalar_to_np.get(item_type)
            head: list[np.ndarray] = [raw_itype, length]
            start = orig_offs + 12
            if scalar is not None:
                values = self._get(start, scalar, int(length[0]))
                parts = head + list(values.reshape(-1, 1))
                return (12 + values.nbytes, parts, list(range(2, len(parts))),
                        [GGUFValueType.ARRAY, item_type])
            if item_type != GGUFValueType.STRING:  # nested arrays: the generic walk
                return super()._get_field_parts(orig_offs, raw_type)
            return _string_array_parts(self.data, self.byte_order, start, int(length[0]), head)

    return PlainArrayReader(str(path), "r")


def _string_array_parts(data: np.ndarray, byte_order: Any, start: int, count: int,
                        head: list[np.ndarray]) -> Any:
    """The reader's parts of a GGUF array of `count` strings at `start`: per
    string its uint64 length and its bytes, as views of data (the same parts
    gguf's generic walk makes). byte_order: the reader's ('I' or 'S')."""
    from gguf import GGUFValueType

    length_type = np.dtype(np.uint64).newbyteorder(byte_order)
    parts, indices, offset = list(head), [], start
    for _ in range(count):
        size = data[offset:offset + 8].view(length_type)
        text = data[offset + 8:offset + 8 + int(size[0])]
        parts += (size, text)
        indices.append(len(parts) - 1)
        offset += 8 + text.nbytes
    return offset - start + 12, parts, indices, [GGUFValueType.ARRAY, GGUFValueType.STRING]


def _field_value(field: Any) -> Any:
    value = field.contents()
    return value.tolist() if isinstance(value, np.ndarray) else value


class GGUFCheckpoint:
    """One GGUF file, memory-mapped; read its config, tokenizer and tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no GGUF file at {self.path}")
        self._reader = _plain_reader(self.path)
        self.metadata: dict[str, Any] = {
            key: _field_value(field) for key, field in self._reader.fields.items()
            if not key.startswith("tokenizer.ggml.")  # big arrays: read on demand
        }
        self.gguf_architecture = str(self.metadata.get("general.architecture", ""))
        self.family = self._family()
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_tensor_types()
        self._config_dict = self._hf_config_dict()

    # ---- what the file is --------------------------------------------------

    def _family(self) -> _Family:
        arch = self.gguf_architecture
        name = str(self.metadata.get("general.name", "")).lower()
        if arch == "llama" and "mistral" in name:
            arch = "mistral"
        family = GGUF_ARCHITECTURES.get(arch)
        if family is None:
            raise UnsupportedGGUFError(self.path, "architecture", self.gguf_architecture,
                                       tuple(GGUF_ARCHITECTURES))
        return family

    def _check_tensor_types(self) -> None:
        for tensor in self._tensors.values():
            kind = tensor.tensor_type.name
            if kind not in SUPPORTED_TENSOR_TYPES:
                raise UnsupportedGGUFError(self.path, f"tensor type (tensor {tensor.name})",
                                           kind, SUPPORTED_TENSOR_TYPES)

    @property
    def tensor_types(self) -> dict[str, int]:
        """How many tensors of each ggml type the file holds."""
        counts: dict[str, int] = {}
        for tensor in self._tensors.values():
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
        return counts

    # ---- config --------------------------------------------------------------

    def _hf_config_dict(self) -> dict[str, Any]:
        """The HF config keys, read through transformers' GGUF table."""
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

        arch = self.gguf_architecture
        table_name = self.family.model_type if self.family.model_type == "mistral" else arch
        mapping: dict[str, Any] = GGUF_CONFIG_MAPPING
        table: dict[str, str | None] = dict(mapping[table_name])
        table.update(_EXTRA_CONFIG_KEYS.get(arch, {}))
        config: dict[str, Any] = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(self.family.model_type, {}))
        for key, name in table.items():
            value = self.metadata.get(f"{arch}.{key}")
            if name is not None and value is not None:
                config[name] = value
        for key, name in mapping["tokenizer"].items():
            value = self._reader.fields.get(f"tokenizer.{key}")
            if value is not None and name is not None:
                config[name] = _field_value(value)
        config["tie_word_embeddings"] = "output.weight" not in self._tensors
        if "vocab_size" not in config:
            config["vocab_size"] = len(self._reader.fields["tokenizer.ggml.tokens"].data)
        config["architectures"] = [self.family.architecture]
        return config

    def hf_config(self) -> Any:
        """A transformers config of the model this file holds (a `ConfigRecord` of
        it when an earlier start stored one: esurge.models.config_record)."""
        return config_for_model(self.family.model_type, self._config_dict)

    # ---- tokenizer -----------------------------------------------------------

    def tokenizer(self) -> GGUFTokenizer | None:
        """The file's tokenizer (vocabulary, merges, special tokens, chat template);
        None when the file carries no vocabulary."""
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

        def read(key: str) -> Any:
            field = self._reader.fields.get(f"tokenizer.{key}")
            return None if field is None else _field_value(field)

        groups = {group: {name: value for key, name in renames.items()
                          if (value := read(key)) is not None}
                  for group, renames in GGUF_TOKENIZER_MAPPING.items()}
        tokens, settings = groups["tokenizer"], groups["tokenizer_config"]
        if "tokens" not in tokens:
            return None
        kind = tokens.get("tokenizer_type")
        if kind == "llama":  # llama.cpp adds BOS to sentencepiece vocabularies by default
            settings.setdefault("add_bos_token", True)
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
            token_id = read(f"ggml.{key}")
            settings[name] = tokens["tokens"][token_id] if token_id is not None else None
        try:
            backend, extra = convert_gguf_tokenizer(self.gguf_architecture, tokens)
        except ValueError as err:
            raise UnsupportedGGUFError(self.path, "tokenizer", str(kind),
                                       ("gpt2", "llama", "t5")) from err
        settings.update(extra)
        return GGUFTokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, **settings))

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Token ids llama.cpp records as ending a turn (eot/eom), besides EOS."""
        found = []
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            value = self.metadata.get(key)
            if isinstance(value, int):
                found.append(value)
        return tuple(found)

    # ---- tensors -------------------------------------------------------------

    def _lookup(self, num_layers: int) -> tuple[Callable[[str], Any], Any]:
        """(HF parameter name -> its gguf tensor, KeyError if absent; the
        transformers processor that undoes llama.cpp's rewrites)."""
        import gguf
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.gguf_architecture)
        names = gguf.get_tensor_name_map(arch, num_layers)
        processor = TENSOR_PROCESSORS.get(self.gguf_architecture, TensorProcessor)(
            config=self._config_dict)

        def tensor_of(hf_name: str) -> Any:
            base, _, suffix = hf_name.rpartition(".")
            gguf_base = names.get_name(base)
            tensor = self._tensors.get(f"{gguf_base}.{suffix}") if gguf_base else None
            if tensor is None:
                raise KeyError(hf_name)
            return tensor

        return tensor_of, processor

    def tensor_reader(self, num_layers: int) -> Callable[[str], np.ndarray]:
        """A function from HF parameter name to its float32 array ([out, in] for a
        linear weight), dequantized and with llama.cpp's rewrites undone."""
        import gguf

        tensor_of, processor = self._lookup(num_layers)

        def read(hf_name: str) -> np.ndarray:
            tensor = tensor_of(hf_name)
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            processed = processor.process(weights=weights, name=tensor.name)
            return np.asarray(processed.weights, dtype=np.float32)

        return read

    def code_reader(self, num_layers: int) -> Callable[[str], WeightCodes | None]:
        """A function from HF parameter name of a linear weight to its codes
        (esurge.models.weight_codes), rows in the HF order; None where the
        tensor's type has no affine form or llama.cpp's rewrite of it is more
        than a reordering of rows. KeyError if absent."""
        tensor_of, processor = self._lookup(num_layers)

        def read(hf_name: str) -> WeightCodes | None:
            tensor = tensor_of(hf_name)
            if len(tensor.shape) != 2:
                return None
            inputs, out = (int(n) for n in tensor.shape)
            codes = weight_codes(tensor.data, tensor.tensor_type.name, (out, inputs))
            if codes is None:
                return None
            # The rewrite applied to the row numbers shows where each row goes.
            index = np.arange(out, dtype=np.float32).reshape(out, 1)
            moved = np.asarray(processor.process(weights=index, name=tensor.name).weights)
            rows = moved.reshape(-1).astype(np.int64)
            if moved.shape != index.shape or not np.array_equal(np.sort(rows), np.arange(out)) \
                    or not np.array_equal(rows, moved.reshape(-1)):
                return None
            return codes.take_rows(rows)

        return read
