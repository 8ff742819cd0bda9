"""A GGUF's transformers config kept on disk as the dict it serializes to.

A GGUF file carries metadata, not a config.json: the config is built by
transformers' config class for the family (`AutoConfig.for_model`), which
fills in the defaults the metadata leaves out. The first use of those classes
imports much of transformers, and torch where it is installed: about 2 s of a
10 s warm restart of the default model on a 2-core CPU, for a result that
depends only on the family, the values read from the file and the
transformers version. So the built config's `to_dict()` is stored as JSON,
named by a digest of those three, and the next start reads it back as a
`ConfigRecord` (attribute access over the same values) without touching the
config classes. A record that cannot be read is built again; writes are
atomic (a temporary file renamed into place).

ESURGE_CONFIG_CACHE names the directory (default ~/.cache/esurge/configs);
an empty value turns the records off.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_CONFIG_CACHE", "ConfigRecord", "ConfigRecords", "config_for_model"]

log = logging.getLogger(__name__)

DEFAULT_CONFIG_CACHE = Path.home() / ".cache" / "esurge" / "configs"
_FORMAT = 1


class ConfigRecord:
    """A stored config: its values as attributes, and the dict and JSON they came from."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        try:
            # Not self._values: before __init__ (copy, pickle) that would recurse here.
            return object.__getattribute__(self, "_values")[name]
        except (AttributeError, KeyError):
            raise AttributeError(name) from None

    def __reduce__(self) -> tuple[type[ConfigRecord], tuple[dict[str, Any]]]:
        return ConfigRecord, (self._values,)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a stored config is read-only (tried to set {name!r})")

    def __repr__(self) -> str:
        return f"ConfigRecord({self._values.get('model_type')!r})"

    def to_dict(self) -> dict[str, Any]:
        """A copy of the values (as a transformers config's `to_dict()`)."""
        return copy.deepcopy(self._values)

    def to_json_string(self) -> str:
        """The values as a config.json would hold them."""
        return json.dumps(self._values, indent=2, sort_keys=True) + "\n"


class ConfigRecords:
    """The directory of stored configs."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @classmethod
    def from_env(cls) -> ConfigRecords | None:
        """The records ESURGE_CONFIG_CACHE names (None when it is set empty)."""
        path = os.environ.get("ESURGE_CONFIG_CACHE", str(DEFAULT_CONFIG_CACHE))
        return cls(Path(path)) if path else None

    @staticmethod
    def digest(model_type: str, values: Mapping[str, Any]) -> str:
        """What a built config depends on: the family, the values given, transformers."""
        inputs = {"format": _FORMAT, "model_type": model_type, "values": values,
                  "transformers": version("transformers")}
        text = json.dumps(inputs, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def read(self, digest: str) -> ConfigRecord | None:
        """The stored config, or None when there is none or it cannot be read."""
        path = self.directory / f"{digest}.json"
        try:
            values = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            log.warning("config record %s unreadable (%s): building the config again", path, err)
            return None
        return ConfigRecord(values) if isinstance(values, dict) else None

    def write(self, digest: str, values: Mapping[str, Any]) -> None:
        """Store a built config's values (atomically; a failure only costs the next start)."""
        temp: str | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "w") as out:
                json.dump(values, out, sort_keys=True)
            os.replace(temp, self.directory / f"{digest}.json")
            temp = None
        except (OSError, TypeError, ValueError) as err:
            log.warning("config record not written to %s: %s", self.directory, err)
        finally:
            if temp is not None:
                Path(temp).unlink(missing_ok=True)


def _built(model_type: str, values: Mapping[str, Any]) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **values)


def config_for_model(model_type: str, values: Mapping[str, Any]) -> Any:
    """transformers' config of `model_type` built from `values`, read from its
    record when an earlier start stored one (a `ConfigRecord`)."""
    records = ConfigRecords.from_env()
    if records is None:
        return _built(model_type, values)
    digest = records.digest(model_type, values)
    stored = records.read(digest)
    if stored is not None:
        return stored
    config = _built(model_type, values)
    records.write(digest, config.to_dict())
    return config
