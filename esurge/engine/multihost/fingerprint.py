"""What every host of one job must agree on, as named entries that can be compared.

A host that loads another checkpoint, another configuration or other code
would compile other programs: its collectives would never meet the
leader's, or would meet them with other data. The handshake compares these
entries and refuses a follower naming every entry that differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
from pathlib import Path
from typing import Any

from esurge.config import Config
from esurge.settings import EngineSettings

__all__ = ["Fingerprint", "differences", "fingerprint"]

Fingerprint = dict[str, str]  # entry name -> value (compared as text)

_PACKAGE = Path(__file__).resolve().parents[2]  # the esurge package directory
# Settings that are meant to differ between the hosts of one job.
_PER_HOST = {"settings.parallel_config.host_rank"}


def _flatten(prefix: str, value: Any, out: Fingerprint) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _flatten(f"{prefix}.{f.name}", getattr(value, f.name), out)
    elif prefix not in _PER_HOST:
        out[prefix] = repr(value)


def _code_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*")):
        if path.suffix in (".py", ".cc", ".h"):
            digest.update(str(path.relative_to(_PACKAGE)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


_SAMPLES = 16  # evenly spaced chunks read from each weight file
_CHUNK = 1 << 16


def _sample_file(path: Path, digest: Any) -> None:
    """A file's size and 16 evenly spaced 64 KiB chunks: two fine-tunes of one
    base (same sizes, same headers) differ there, and no checkpoint is read whole."""
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        for i in range(_SAMPLES):
            f.seek(max(0, (size - _CHUNK) * i // (_SAMPLES - 1)))
            digest.update(f.read(_CHUNK))


def _model_digest(model_path: Path) -> str:
    """config.json's bytes and samples of every weight file (a GGUF: of the file)."""
    digest = hashlib.sha256()
    if model_path.is_file():
        _sample_file(model_path, digest)
        return digest.hexdigest()[:16]
    config = model_path / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for weights in sorted(model_path.glob("*.safetensors")):
        _sample_file(weights, digest)
    return digest.hexdigest()[:16]


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def fingerprint(model_path: Path, config: Config, settings: EngineSettings) -> Fingerprint:
    """The entries a follower must share with its leader."""
    out: Fingerprint = {"model": _model_digest(model_path), "esurge code": _code_digest(),
                        "jax": _version("jax"), "jaxlib": _version("jaxlib"),
                        "flax": _version("flax")}
    _flatten("config", config, out)
    _flatten("settings", settings, out)
    return out


def differences(mine: Fingerprint, theirs: Fingerprint) -> list[str]:
    """'entry: leader value vs follower value' for each entry that differs."""
    names = sorted(set(mine) | set(theirs))
    return [f"{name}: {mine.get(name, '<missing>')} vs {theirs.get(name, '<missing>')}"
            for name in names if mine.get(name) != theirs.get(name)]
