"""The layout cache: a restart reads the serving layout the first load stored,
and never serves a layout its checkpoint, CPU paths or code no longer make."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from esurge.models import LoadedModel, load_model
from esurge.models.layout_cache import LayoutCache, wait_for_writes
from tests.models.checkpoints import build_model, hf_config, save_checkpoint
from tests.models.gguf_export import export_gguf

READ = "serving layout read from the layout cache"


def _checkpoint(kind: str, directory: Path, seed: int = 0) -> Path:
    """A tiny Llama as safetensors, or exported to a 4-bit GGUF (served from its codes)."""
    model = build_model(hf_config("llama", hidden_size=256, intermediate_size=512,
                                  tie_word_embeddings=kind == "gguf"), seed=seed)
    save_checkpoint(model, directory / "hf")
    if kind == "safetensors":
        return directory / "hf"
    return export_gguf(directory / "hf", "llama", directory / "m.gguf", qtype=Q.Q4_1)


def _load(path: Path, caplog: pytest.LogCaptureFixture) -> tuple[LoadedModel, bool]:
    """The model, and whether its layout came from the cache."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="esurge.models.loader"):
        loaded = load_model(path)
    wait_for_writes()
    return loaded, any(READ in r.getMessage() for r in caplog.records)


def _assert_same(a: LoadedModel, b: LoadedModel) -> None:
    assert a.config == b.config
    left, right = jax.tree_util.tree_leaves_with_path(a.params), jax.tree_util.tree_leaves(b.params)
    assert len(left) == len(right)
    for (path, x), y in zip(left, right, strict=True):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.safetensors"))


@pytest.fixture
def layouts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "layouts"
    monkeypatch.setenv("ESURGE_LAYOUT_CACHE", str(cache))
    return cache


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_a_second_load_serves_the_layout_the_first_stored(
        kind: str, layouts: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = _checkpoint(kind, tmp_path)
    first, read = _load(path, caplog)
    assert not read and len(_entries(layouts)) == 1
    assert _entries(layouts)[0].stat().st_mode & 0o777 == 0o644  # readable by other users
    second, read = _load(path, caplog)
    assert read
    _assert_same(first, second)
    if kind == "gguf":  # the coded roles come back from the entry's metadata
        assert second.config.coded_weights == (
            ("down_proj", 4), ("gate_up_proj", 4), ("lm_head", 4), ("o_proj", 4),
            ("qkv_proj", 4))
    monkeypatch.setenv("ESURGE_LAYOUT_CACHE", "")
    built, _ = _load(path, caplog)
    _assert_same(built, second)


def test_a_rewritten_checkpoint_is_built_again(layouts: Path, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    path = _checkpoint("safetensors", tmp_path, seed=0)
    old, _ = _load(path, caplog)
    _checkpoint("safetensors", tmp_path, seed=1)  # new weights under the same path
    new, read = _load(path, caplog)
    assert not read
    assert not np.array_equal(np.asarray(old.params["model"]["embed_tokens"]["weight"]),
                              np.asarray(new.params["model"]["embed_tokens"]["weight"]))
    again, read = _load(path, caplog)
    assert read
    _assert_same(new, again)


def test_another_cpu_path_has_its_own_entry(layouts: Path, tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Dual layouts (no AVX-512) keep plain weights beside the panels: the
    entry of one CPU path must not serve the other."""
    import esurge.models.loader as loader

    path = _checkpoint("safetensors", tmp_path)
    _load(path, caplog)
    avx512 = loader.cpu_has_avx512()
    monkeypatch.setattr(loader, "cpu_has_avx512", lambda: not avx512)
    other, read = _load(path, caplog)
    assert not read and other.config.dual_layout == avx512
    assert len(_entries(layouts)) == 2


def test_another_gguf_version_has_its_own_entry(layouts: Path, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """gguf's dequantizers make a GGUF's float weights: a new gguf must not
    be served what an old one dequantized."""
    import esurge.models.layout_cache as layout_cache

    path = _checkpoint("gguf", tmp_path)
    _load(path, caplog)
    real = layout_cache.version
    monkeypatch.setattr(layout_cache, "version",
                        lambda name: "999.0" if name == "gguf" else real(name))
    _, read = _load(path, caplog)
    assert not read and len(_entries(layouts)) == 2


@pytest.mark.parametrize("damage", ["truncated", "another tree"])
def test_an_unusable_entry_is_rebuilt(damage: str, layouts: Path, tmp_path: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    path = _checkpoint("safetensors", tmp_path)
    first, _ = _load(path, caplog)
    (entry,) = _entries(layouts)
    if damage == "truncated":
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    else:  # whole, but not this model's tree
        LayoutCache(layouts).write(entry.name.removesuffix(".safetensors"),
                                   {"model": {"w": jax.numpy.zeros(3)}}, {})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="esurge.models.layout_cache"):
        rebuilt = load_model(path)
    wait_for_writes()
    assert any("unusable" in r.getMessage() for r in caplog.records)
    _assert_same(first, rebuilt)
    again, read = _load(path, caplog)  # the rebuilt layout was stored again
    assert read
    _assert_same(first, again)


def test_an_empty_setting_turns_the_cache_off(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESURGE_LAYOUT_CACHE", "")
    assert LayoutCache.from_env() is None
    path = _checkpoint("safetensors", tmp_path)
    _load(path, caplog)
    _, read = _load(path, caplog)
    assert not read
    assert list(tmp_path.rglob("*.safetensors")) == [path / "model.safetensors"]


def test_only_the_most_recently_used_entries_are_kept(tmp_path: Path) -> None:
    cache = LayoutCache(tmp_path, max_entries=2)
    abstract = {"w": jax.ShapeDtypeStruct((4,), jax.numpy.float32)}

    def entry(digest: str) -> Path:
        return tmp_path / f"{digest}.safetensors"

    for digest in "ab":
        cache.write(digest, {"w": jax.numpy.arange(4, dtype=jax.numpy.float32)}, {})
    os.utime(entry("a"), (1_000, 1_000))  # "a" stored long before "b"
    os.utime(entry("b"), (2_000, 2_000))
    assert cache.read("a", lambda metadata: abstract) is not None  # "a" used last now
    cache.write("c", {"w": jax.numpy.ones(4, dtype=jax.numpy.float32)}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "c.safetensors"]


def test_entries_stay_within_the_size_limit(tmp_path: Path) -> None:
    """Stored layouts stay within max_bytes (oldest dropped first); one larger
    than the limit by itself is not stored."""
    cache = LayoutCache(tmp_path, max_entries=10, max_bytes=3 * 4096 + 2048)
    for i, digest in enumerate("abcd"):  # about 4 KiB each with the header
        cache.write(digest, {"w": jax.numpy.zeros(1000, dtype=jax.numpy.float32)}, {})
        os.utime(tmp_path / f"{digest}.safetensors", (1_000 + i, 1_000 + i))
    cache.write("e", {"w": jax.numpy.zeros(1000, dtype=jax.numpy.float32)}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "c.safetensors", "d.safetensors", "e.safetensors"]
    cache.write("big", {"w": jax.numpy.zeros(4000, dtype=jax.numpy.float32)}, {})
    assert not (tmp_path / "big.safetensors").exists()

