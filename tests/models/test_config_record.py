"""GGUF configs read back from their records: the same model as transformers' config
classes build, for every family we serve, and a bad record only costs a rebuild."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import gguf
import pytest

from esurge.core.kv_cache_spec import cache_groups_from_hf_config
from esurge.models.checkpoint import open_checkpoint
from esurge.models.config_record import ConfigRecord, ConfigRecords
from esurge.models.families import decoder_config_from_hf
from esurge.models.gguf_file import GGUFCheckpoint
from esurge.models.registry import architecture_of, policy_for
from tests.models.checkpoints import build_model, hf_config, save_checkpoint
from tests.models.gguf_export import export_gguf

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")


@pytest.fixture
def records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "configs"
    monkeypatch.setenv("ESURGE_CONFIG_CACHE", str(directory))
    return directory


def _gguf(tmp_path: Path, family: str) -> Path:
    # llama.cpp's Gemma 2 has no output tensor: its embeddings are always tied.
    tied = {"tie_word_embeddings": True} if family == "gemma2" else {}
    save_checkpoint(build_model(hf_config(family, **tied), seed=3), tmp_path / "hf")
    return export_gguf(tmp_path / "hf", family, tmp_path / f"{family}.gguf",
                       qtype=gguf.GGMLQuantizationType.F32)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_record_describes_the_same_model_as_the_config_classes(
        family: str, tmp_path: Path, records: Path) -> None:
    path = _gguf(tmp_path, family)
    built = GGUFCheckpoint(path).hf_config()
    assert not isinstance(built, ConfigRecord)
    assert len(list(records.glob("*.json"))) == 1
    stored = GGUFCheckpoint(path).hf_config()
    assert isinstance(stored, ConfigRecord)
    # What a config.json of it holds (JSON keys are strings: id2label's ints are not).
    assert stored.to_dict() == json.loads(json.dumps(built.to_dict()))
    assert architecture_of(stored) == architecture_of(built)
    policy = policy_for(architecture_of(built))
    assert decoder_config_from_hf(stored, policy) == decoder_config_from_hf(built, policy)
    assert (cache_groups_from_hf_config(stored, 64, 8) == cache_groups_from_hf_config(built, 64, 8))
    first, second = open_checkpoint(path), open_checkpoint(path)
    assert first.eos_token_ids(built) == second.eos_token_ids(stored)


def test_an_unreadable_record_is_built_again(tmp_path: Path, records: Path) -> None:
    path = _gguf(tmp_path, "llama")
    GGUFCheckpoint(path).hf_config()
    (record,) = records.glob("*.json")
    record.write_text("{not json")
    rebuilt = GGUFCheckpoint(path).hf_config()
    assert not isinstance(rebuilt, ConfigRecord)
    assert isinstance(GGUFCheckpoint(path).hf_config(), ConfigRecord)  # written anew


def test_records_off_when_the_variable_is_empty(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESURGE_CONFIG_CACHE", "")
    path = _gguf(tmp_path, "llama")
    for _ in range(2):
        assert not isinstance(GGUFCheckpoint(path).hf_config(), ConfigRecord)


def test_a_config_that_cannot_be_stored_leaves_nothing(tmp_path: Path) -> None:
    records = ConfigRecords(tmp_path)
    records.write("x", {"model_type": "llama", "odd": object()})  # not JSON
    assert list(tmp_path.iterdir()) == []
    assert records.read("x") is None


def test_the_digest_follows_every_value_and_the_family() -> None:
    base = ConfigRecords.digest("llama", {"hidden_size": 64, "rope_theta": 10000.0})
    assert base == ConfigRecords.digest("llama", {"rope_theta": 10000.0, "hidden_size": 64})
    assert base != ConfigRecords.digest("llama", {"hidden_size": 64, "rope_theta": 500000.0})
    assert base != ConfigRecords.digest("qwen2", {"hidden_size": 64, "rope_theta": 10000.0})


def test_a_record_is_read_only() -> None:
    record = ConfigRecord({"model_type": "llama", "hidden_size": 64})
    assert record.hidden_size == 64 and not hasattr(record, "text_config")
    with pytest.raises(AttributeError, match="read-only"):
        record.hidden_size = 32  # type: ignore[misc]
    values = record.to_dict()
    values["hidden_size"] = 1
    assert record.hidden_size == 64
    # Copied and pickled whole, as a transformers config can be.
    for twin in (copy.deepcopy(record), pickle.loads(pickle.dumps(record))):
        assert twin.to_dict() == {"model_type": "llama", "hidden_size": 64}
