"""Native kernels for XLA:CPU, built on first use with the machine's C++ compiler.

`paged_attention.cc` (with `attention_tiles.h`) reads keys and values straight from the paged cache
(the pure-JAX path must gather them into a new buffer first, which triples the
memory traffic of a decode step on CPU). The shared library is compiled once
per (source, compiler, CPU) into a cache directory and registered as an XLA
FFI target; `kernel_available()` is False, with one warning in the log, when
that is impossible (no compiler, a failed build), and callers then use the
pure-JAX path, which computes the same thing.

Environment:
    ESURGE_CPU_KERNELS=0      never build or use the kernels
    ESURGE_KERNEL_CACHE=DIR   where built libraries go (default
                              ~/.cache/esurge/kernels)
    CXX                       the compiler (default c++)
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["TARGET", "kernel_available", "paged_attention_kernel"]

log = logging.getLogger(__name__)

TARGET = "esurge_paged_attention"
_SOURCE = Path(__file__).with_name("paged_attention.cc")
_HEADERS = (Path(__file__).with_name("attention_tiles.h"),)
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _compiler_version(cxx: str) -> str:
    done = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    return done.stdout


def _build(cxx: str) -> Path:
    """The library's path, compiling it unless this exact build is cached."""
    source = b"".join(path.read_bytes() for path in (_SOURCE, *_HEADERS))
    include = jax.ffi.include_dir()
    key = hashlib.sha256(b"\0".join([
        source, " ".join(_FLAGS).encode(), _compiler_version(cxx).encode(),
        jax.__version__.encode(), _cpu_signature().encode(),
    ])).hexdigest()[:20]
    cache = Path(os.environ.get("ESURGE_KERNEL_CACHE", Path.home() / ".cache/esurge/kernels"))
    lib = cache / f"paged_attention-{key}.so"
    if lib.is_file():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run([cxx, *_FLAGS, f"-I{include}", str(_SOURCE), "-o", tmp],
                       capture_output=True, text=True, check=True)
        os.replace(tmp, lib)  # atomic: concurrent builders end with one whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _load() -> bool:
    if os.environ.get("ESURGE_CPU_KERNELS", "1") == "0":
        return False
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        log.warning("no C++ compiler found: paged attention uses the pure-JAX path on CPU")
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build(cxx)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.EsurgePagedAttention),
                                    platform="cpu")
    except (OSError, subprocess.CalledProcessError, AttributeError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        log.warning("CPU paged-attention kernel unavailable (%s); using the pure-JAX path",
                    detail.strip()[:2000])
        return False
    return True


def kernel_available() -> bool:
    """True when the CPU kernel is built and registered (built on the first call)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return _state["ok"]


def paged_attention_kernel(
    q: jax.Array,  # [T, num_heads, head_dim] float32
    k: jax.Array,  # [T, kv_heads, head_dim] float32: this step's keys
    v: jax.Array,  # [T, kv_heads, head_dim] float32: this step's values
    slot_mapping: jax.Array,  # [T] int32: page_id * page_size + offset
    k_cache: jax.Array,  # [num_pages, page_size, kv_heads, head_dim] float32
    v_cache: jax.Array,  # [num_pages, page_size, kv_heads, head_dim] float32
    positions: jax.Array,  # [T] int32
    token_req: jax.Array,  # [T] int32
    page_tables: jax.Array,  # [R, P] int32
    num_tokens: jax.Array,  # [] int32
    *,
    scale: float,
    sliding_window: int | None,
    chunk_size: int | None,
    softcap: float | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(attention [T, num_heads, head_dim], k_cache, v_cache) with k, v written first.

    Same result as write_kv followed by the pure-JAX paged attention (see the
    .cc file); the caches are updated in place when the caller donates them.
    """
    cache = jax.ShapeDtypeStruct(k_cache.shape, jnp.float32)
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct(q.shape, jnp.float32), cache, cache),
                            input_output_aliases={4: 1, 5: 2})
    out, k_cache, v_cache = call(
        q, k, v, slot_mapping.astype(jnp.int32), k_cache, v_cache,
        positions.astype(jnp.int32), token_req.astype(jnp.int32),
        page_tables.astype(jnp.int32), jnp.asarray(num_tokens, jnp.int32),
        scale=np.float32(scale), sliding_window=np.int64(sliding_window or 0),
        chunk_size=np.int64(chunk_size or 0), softcap=np.float32(softcap or 0.0),
    )
    return out, k_cache, v_cache
