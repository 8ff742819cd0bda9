"""The persistent XLA compile cache, on by default, so a restart skips most of the warm-up."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

__all__ = ["DEFAULT_COMPILE_CACHE", "enable_compile_cache"]

log = logging.getLogger(__name__)

DEFAULT_COMPILE_CACHE = Path.home() / ".cache" / "esurge" / "xla"


def enable_compile_cache() -> str | None:
    """Keep compiled programs on disk; returns the directory in use (None: off).

    A directory already configured for JAX (`jax_compilation_cache_dir`, e.g.
    from JAX_COMPILATION_CACHE_DIR) is kept with its settings. Otherwise
    ESURGE_COMPILE_CACHE names the directory (default ~/.cache/esurge/xla) and
    an empty value turns the cache off. JAX fixes whether it uses the cache at
    the process's first compile, so this takes effect when it runs before it
    (eSurge calls it first thing).
    """
    configured = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # not in the stubs
    if configured:
        return str(configured)
    path = os.environ.get("ESURGE_COMPILE_CACHE", str(DEFAULT_COMPILE_CACHE))
    if not path:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    # Every program, however small or quick to compile: a warm-up runs dozens.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log.debug("persistent compile cache at %s", path)
    return path
