"""Serving layouts kept on disk, so a restart skips building them again.

Building a checkpoint's single-device serving layout (reading the tensors,
dequantizing a GGUF's blocks, fusing projections, packing panels) takes most
of a model load: 5-6 s for the default model on a 2-core CPU, at every start.
The result depends only on the checkpoint's files, the serving dtype, the
CPU paths the layout is made for, the code that builds it and the versions
of the libraries it uses (jax, numpy, gguf's dequantizers), so it is
stored once as a safetensors file named by a digest of all of those, and
read back (about 0.6 s for that model) by the next start with the same
digest. An entry whose inputs changed has another name and is never read; an
entry that cannot be read is rebuilt. Writes are atomic (a temporary file
renamed into place), and only the most recently used entries are kept. A
write runs beside the start that built the layout, from the arrays' own
buffers (no second copy in memory): about 1 s for the default model.

ESURGE_LAYOUT_CACHE names the directory (default ~/.cache/esurge/layouts);
an empty value turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import jax
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

__all__ = ["DEFAULT_LAYOUT_CACHE", "MAX_BYTES", "MAX_ENTRIES", "LayoutCache", "LayoutInputs",
           "wait_for_writes"]

log = logging.getLogger(__name__)

DEFAULT_LAYOUT_CACHE = Path.home() / ".cache" / "esurge" / "layouts"
# A layout is about as large as the float32 model, twice that where plain
# weights are kept beside the panels (650 MB for the default model on AVX2),
# so only the few most recently used are kept, within a total size, and a
# layout larger than that total is not stored at all.
MAX_ENTRIES = 3
MAX_BYTES = 8 << 30
_FORMAT = 1
_SUFFIX = ".safetensors"
# A temporary file this old is left from a write that never finished.
_STALE_TEMP_SECONDS = 3600

_writes: list[threading.Thread] = []  # started by write_in_background
_writes_lock = threading.Lock()
# The code that decides a layout: the model package (loading, fusing, packing).
_CODE_ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class LayoutInputs:
    """Everything a single-device serving layout depends on besides the code."""

    model_path: Path  # a checkpoint directory or a .gguf file
    dtype: str
    fuse: bool
    packed: bool
    dual: bool
    cpu: tuple[tuple[str, bool], ...]  # the CPU features the kernels' layouts follow

    def digest(self) -> str:
        """A digest of these inputs, the checkpoint's files and the layout code."""
        h = hashlib.sha256()
        h.update(json.dumps({"format": _FORMAT, "dtype": self.dtype, "fuse": self.fuse,
                             "packed": self.packed, "dual": self.dual, "cpu": self.cpu,
                             # gguf's dequantizers make a GGUF's float weights.
                             "versions": [version(p) for p in ("jax", "numpy", "gguf")],
                             "files": _file_stamps(self.model_path)}).encode())
        for source in sorted(_CODE_ROOT.rglob("*")):
            if source.suffix in (".py", ".cc", ".h"):
                h.update(str(source.relative_to(_CODE_ROOT)).encode())
                h.update(source.read_bytes())
        return h.hexdigest()[:32]


def _file_stamps(model_path: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime in ns) of the checkpoint's files: a rewritten file changes them."""
    path = model_path.resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return [(str(f), (st := f.stat()).st_size, st.st_mtime_ns) for f in files]


def _name(path: tuple[Any, ...]) -> str:
    return ".".join(str(getattr(key, "key", key)) for key in path)


class LayoutCache:
    """One directory of stored layouts."""

    def __init__(self, directory: Path, max_entries: int = MAX_ENTRIES,
                 max_bytes: int = MAX_BYTES) -> None:
        self.directory = directory
        self.max_entries = max_entries
        self.max_bytes = max_bytes

    @classmethod
    def from_env(cls) -> LayoutCache | None:
        """The cache ESURGE_LAYOUT_CACHE names (None when it is set empty)."""
        path = os.environ.get("ESURGE_LAYOUT_CACHE", str(DEFAULT_LAYOUT_CACHE))
        return cls(Path(path)) if path else None

    def _entry(self, digest: str) -> Path:
        return self.directory / f"{digest}{_SUFFIX}"

    def read(self, digest: str, abstract_for: Callable[[dict[str, str]], Mapping[str, Any]]
             ) -> dict[str, Any] | None:
        """The stored params, shaped like the abstract tree `abstract_for` makes
        of the entry's metadata; None when there is no usable entry (a damaged
        one is removed)."""
        entry = self._entry(digest)
        if not entry.is_file():
            return None
        try:
            with safe_open(str(entry), framework="flax") as f:
                abstract = abstract_for(dict(f.metadata() or {}))

                def load(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.Array:
                    array = f.get_tensor(_name(path))
                    if array.shape != tuple(leaf.shape) or array.dtype != leaf.dtype:
                        raise ValueError(f"{_name(path)}: stored {array.dtype}{list(array.shape)}"
                                         f", the model has {leaf.dtype}{list(leaf.shape)}")
                    return array

                params = jax.tree_util.tree_map_with_path(load, dict(abstract))
        except (OSError, SafetensorError, ValueError, KeyError) as err:
            log.warning("layout cache entry %s unusable (%s); rebuilding it", entry.name, err)
            _remove(entry)
            return None
        os.utime(entry)  # most recently used: kept longest
        return params

    def write_in_background(self, digest: str, params: Mapping[str, Any],
                            metadata: dict[str, str]) -> threading.Thread:
        """Start `write` on a thread of its own: the start that built the
        layout does not wait for the disk. Not a daemon: the interpreter
        waits for it at exit (a write cut off there would abort the process
        inside the writer's native code)."""
        thread = threading.Thread(target=self.write, args=(digest, params, metadata),
                                  name="layout-cache-write")
        with _writes_lock:
            _writes.append(thread)
        thread.start()
        return thread

    def write(self, digest: str, params: Mapping[str, Any], metadata: dict[str, str]) -> None:
        """Store params under digest (atomically), then drop the least recently used."""
        flat = {_name(path): leaf
                for path, leaf in jax.tree_util.tree_leaves_with_path(dict(params))}
        size = sum(leaf.nbytes for leaf in flat.values())
        if size > self.max_bytes:
            log.info("serving layout not cached: %.1f GiB is more than the cache's %.1f GiB",
                     size / 2**30, self.max_bytes / 2**30)
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=self.directory)
            os.close(fd)
            try:
                save_file(flat, tmp, metadata=metadata)
                # mkstemp's 0600 would lock other users out of a shared cache directory.
                os.chmod(tmp, 0o644)
                os.replace(tmp, self._entry(digest))
            finally:
                Path(tmp).unlink(missing_ok=True)
            self._evict()
        except (OSError, SafetensorError) as err:  # a full disk costs the next start time
            log.warning("could not store the serving layout in %s: %s", self.directory, err)

    def _evict(self) -> None:
        # Another process may be evicting too: a file gone meanwhile is no error.
        entries = sorted(self.directory.glob(f"*{_SUFFIX}"), key=_mtime, reverse=True)
        stale = time.time() - _STALE_TEMP_SECONDS
        drop = [t for t in self.directory.glob("*.tmp") if _mtime(t) < stale]
        total = 0
        for i, entry in enumerate(entries):
            total += _size(entry)
            if i >= self.max_entries or total > self.max_bytes:
                drop.append(entry)
        for old in drop:
            _remove(old)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as err:  # e.g. a directory shared read-only: the entry stays
        log.warning("could not remove %s: %s", path, err)


def wait_for_writes() -> None:
    """Return once every layout this process began storing is stored (or failed)."""
    with _writes_lock:
        pending = list(_writes)
        _writes.clear()
    for thread in pending:
        thread.join()
