"""Native kernels for XLA:CPU, built on first use with the machine's C++ compiler.

`paged_attention.cc` (with `attention_tiles.h`) reads keys and values straight
from the paged cache (the pure-JAX path must gather them into a new buffer
first, which triples the memory traffic of a decode step on CPU).
`packed_matmul.cc` multiplies few-row activations by weights packed once into
contiguous column panels (XLA's matmul walks an [in, out] weight with strides
the prefetcher does not follow and repacks it on every call).
`coded_matmul.cc` does the same for weights kept as a GGUF's integer codes,
expanded to float32 in cache (through the same register tiles,
`panel_tiles.h`), and `widened_matmul.cc` for bfloat16 weights served in
float32 (half the bytes of upcast panels, widened in registers).
`bf16_matmul.cc` multiplies bfloat16 panels with the CPU's
own bfloat16 dot products (AMX tiles, AVX512_BF16), built where the CPU has
them (`cpu_has_bf16_dot`), and `coded_bf16_matmul.cc` a GGUF's codes the
same way (VDPBF16PS on the codes themselves, the blocks' scales applied to
the sums). All share `parallel_for.h`. The shared library is compiled
once per (sources, compiler, CPU) into a cache directory and its handlers
registered as XLA FFI targets; `kernel_available()` is False, with one
warning in the log, when that is impossible (no compiler, a failed build),
and callers then use pure-JAX paths, which compute the same thing.

Environment:
    ESURGE_CPU_KERNELS=0      never build or use the kernels
    ESURGE_KERNEL_CACHE=DIR   where built libraries go (default
                              ~/.cache/esurge/kernels)
    ESURGE_WIDENED_PANELS=0   upcast a bfloat16 checkpoint served in float32
                              to float32 panels (widened_panels_enabled)
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

__all__ = [
    "BF16_CACHE_TARGET",
    "BF16_F32_TARGET",
    "BF16_TARGET",
    "CODED_BF16_F32_TARGET",
    "CODED_BF16_TARGET",
    "CODED_TARGET",
    "MATMUL_TARGET",
    "PANEL",
    "TARGET",
    "WIDENED_TARGET",
    "attention_kernel_serves",
    "coded_matmul_kernel",
    "cpu_has_amx",
    "cpu_has_avx512",
    "cpu_has_bf16_dot",
    "kernel_available",
    "kernels_serve",
    "packed_matmul_kernel",
    "paged_attention_kernel",
    "widened_matmul_kernel",
    "widened_panels_enabled",
]

log = logging.getLogger(__name__)

TARGET = "esurge_paged_attention"
BF16_CACHE_TARGET = "esurge_paged_attention_bf16"
MATMUL_TARGET = "esurge_packed_matmul"
CODED_TARGET = "esurge_coded_matmul"
WIDENED_TARGET = "esurge_widened_matmul"  # bfloat16 panels, float32 arithmetic
BF16_TARGET = "esurge_bf16_matmul"
BF16_F32_TARGET = "esurge_bf16_matmul_f32"  # float32 results: row-parallel partial sums
CODED_BF16_TARGET = "esurge_coded_bf16_matmul"  # integer codes, bfloat16 dot products
CODED_BF16_F32_TARGET = "esurge_coded_bf16_matmul_f32"  # the same, float32 results
PANEL = 32  # output columns per packed weight panel (kPanel in packed_matmul.cc)
_HERE = Path(__file__).parent
_SOURCES = (_HERE / "paged_attention.cc", _HERE / "packed_matmul.cc", _HERE / "coded_matmul.cc",
            _HERE / "widened_matmul.cc", _HERE / "bf16_matmul.cc", _HERE / "coded_bf16_matmul.cc")
_HEADERS = (_HERE / "attention_tiles.h", _HERE / "bf16_store.h", _HERE / "coded_args.h",
            _HERE / "fast_exp.h", _HERE / "panel_call.h", _HERE / "panel_tiles.h",
            _HERE / "parallel_for.h")
# -ffp-contract=fast: ISO -std modes otherwise forbid fusing a*b+c into one FMA.
_COMPILE_FLAGS = ("-O3", "-march=native", "-std=c++17", "-ffp-contract=fast", "-fPIC")
_LINK_FLAGS = ("-shared",)
_FLAGS = (*_COMPILE_FLAGS, *_LINK_FLAGS)
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_has_avx512() -> bool:
    """True when this CPU runs AVX-512F (read from /proc/cpuinfo at run time)."""
    return "avx512f" in _cpu_flags()


def cpu_has_amx() -> bool:
    """True when this CPU has AMX bfloat16 tiles (the bfloat16 kernel uses them for
    steps of 8 rows and more, where Linux grants the tile state)."""
    return {"amx_bf16", "amx_tile"} <= _cpu_flags()


def widened_panels_enabled() -> bool:
    """True unless ESURGE_WIDENED_PANELS=0: a bfloat16 checkpoint served in
    float32 keeps its own values in bfloat16 panels (widened_matmul.cc; the
    same products in half the bytes) rather than upcast float32 panels."""
    return os.environ.get("ESURGE_WIDENED_PANELS", "1") != "0"


def cpu_has_bf16_dot() -> bool:
    """True when this CPU multiplies bfloat16 natively (AVX512_BF16's VDPBF16PS;
    AMX-BF16 tiles are used on top where present). Read at run time; the
    kernel build targets the same CPU (-march=native)."""
    return "avx512_bf16" in _cpu_flags() and os.environ.get("ESURGE_BF16_KERNELS", "1") != "0"


def _compiler_version(cxx: str) -> str:
    done = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    return done.stdout


def _build(cxx: str) -> Path:
    """The library's path, compiling it unless this exact build is cached."""
    source = b"".join(path.read_bytes() for path in (*_SOURCES, *_HEADERS))
    include = jax.ffi.include_dir()
    key = hashlib.sha256(b"\0".join([
        source, " ".join(_FLAGS).encode(), _compiler_version(cxx).encode(),
        jax.__version__.encode(), _cpu_signature().encode(),
    ])).hexdigest()[:20]
    cache = Path(os.environ.get("ESURGE_KERNEL_CACHE", Path.home() / ".cache/esurge/kernels"))
    lib = cache / f"esurge_kernels-{key}.so"
    if lib.is_file():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as work:
        objects = _compile_objects(cxx, include, Path(work))
        tmp = Path(work) / "lib.so"
        subprocess.run([cxx, *_LINK_FLAGS, *map(str, objects), "-o", str(tmp)],
                       capture_output=True, text=True, check=True)
        os.replace(tmp, lib)  # atomic: concurrent builders end with one whole file
    return lib


def _compile_objects(cxx: str, include: str, work: Path) -> list[Path]:
    """Each source compiled to an object in work, all at once: the sources
    build in 12, 5 and 7 s on a 2-core machine, 24 s one after another, and
    the build is part of a first start."""
    objects = [work / f"{path.stem}.o" for path in _SOURCES]
    builds = [subprocess.Popen([cxx, *_COMPILE_FLAGS, f"-I{include}", "-c", str(path),
                                "-o", str(obj)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
              for path, obj in zip(_SOURCES, objects, strict=True)]
    failed = None
    for build in builds:
        out, err = build.communicate()
        if build.returncode and failed is None:
            failed = subprocess.CalledProcessError(build.returncode, build.args, out, err)
    if failed is not None:
        raise failed
    return objects


def _load() -> bool:
    if os.environ.get("ESURGE_CPU_KERNELS", "1") == "0":
        return False
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        log.warning("no C++ compiler found: attention and matmuls use pure-JAX paths on CPU")
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build(cxx)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.EsurgePagedAttention),
                                    platform="cpu")
        jax.ffi.register_ffi_target(BF16_CACHE_TARGET,
                                    jax.ffi.pycapsule(lib.EsurgePagedAttentionBf16),
                                    platform="cpu")
        jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(lib.EsurgePackedMatmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(CODED_TARGET, jax.ffi.pycapsule(lib.EsurgeCodedMatmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(WIDENED_TARGET, jax.ffi.pycapsule(lib.EsurgeWidenedMatmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(BF16_TARGET, jax.ffi.pycapsule(lib.EsurgeBf16Matmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(BF16_F32_TARGET,
                                    jax.ffi.pycapsule(lib.EsurgeBf16MatmulF32), platform="cpu")
        jax.ffi.register_ffi_target(CODED_BF16_TARGET,
                                    jax.ffi.pycapsule(lib.EsurgeCodedBf16Matmul), platform="cpu")
        jax.ffi.register_ffi_target(CODED_BF16_F32_TARGET,
                                    jax.ffi.pycapsule(lib.EsurgeCodedBf16MatmulF32),
                                    platform="cpu")
    except (OSError, subprocess.CalledProcessError, AttributeError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        log.warning("CPU kernels unavailable (%s); using the pure-JAX paths",
                    detail.strip()[:2000])
        return False
    return True


def kernel_available() -> bool:
    """True when the CPU kernels are built and registered (built on the first call)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return _state["ok"]


def kernels_serve(dtype: jnp.dtype | str) -> bool:
    """True when arrays of this dtype on the default JAX platform can use the
    kernels: XLA:CPU, the library built, and float32, or bfloat16 on a CPU
    with native bfloat16 dot products."""
    dtype = jnp.dtype(dtype)
    served = dtype == jnp.float32 or (dtype == jnp.bfloat16 and cpu_has_bf16_dot())
    return jax.default_backend() == "cpu" and served and kernel_available()


def paged_attention_kernel(
    q: jax.Array,  # [T, num_heads, head_dim]
    k: jax.Array,  # [T, kv_heads, head_dim]: this step's keys
    v: jax.Array,  # [T, kv_heads, head_dim]: this step's values
    slot_mapping: jax.Array,  # [T] int32: page_id * page_size + offset
    k_cache: jax.Array,  # [num_pages, page_size, kv_heads, head_dim] float32 or bfloat16
    v_cache: jax.Array,  # [num_pages, page_size, kv_heads, head_dim], k_cache's dtype
    positions: jax.Array,  # [T] int32
    token_req: jax.Array,  # [T] int32
    page_tables: jax.Array,  # [R, P] int32
    num_tokens: jax.Array,  # [] int32
    *,
    scale: float,
    sliding_window: int | None,
    chunk_size: int | None,
    softcap: float | None,
    rope: tuple[jax.Array, jax.Array] | None = None,  # cos, sin [T, head_dim]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(attention [T, num_heads, head_dim] float32, k_cache, v_cache) with k, v written first.

    Same result as (apply_rope to q and k when rope is given, then) write_kv
    followed by the pure-JAX paged attention (see the .cc file); the caches
    are updated in place when the caller donates them. q, k and v are taken
    in float32 whatever the cache's dtype; a bfloat16 cache stores them rounded.
    """
    if rope is None:
        cos = sin = jnp.zeros((1, q.shape[-1]), jnp.float32)  # unread
    else:
        cos, sin = (t.astype(jnp.float32) for t in rope)
    cache = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    target = TARGET if k_cache.dtype == jnp.float32 else BF16_CACHE_TARGET
    call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct(q.shape, jnp.float32), cache, cache),
                            input_output_aliases={4: 1, 5: 2})
    f32 = jnp.float32
    out, k_cache, v_cache = call(
        q.astype(f32), k.astype(f32), v.astype(f32), slot_mapping.astype(jnp.int32), k_cache,
        v_cache,
        positions.astype(jnp.int32), token_req.astype(jnp.int32),
        page_tables.astype(jnp.int32), jnp.asarray(num_tokens, jnp.int32), cos, sin,
        scale=np.float32(scale), sliding_window=np.int64(sliding_window or 0),
        chunk_size=np.int64(chunk_size or 0), softcap=np.float32(softcap or 0.0),
        rotate=rope is not None,
    )
    return out, k_cache, v_cache


def packed_matmul_kernel(
    x: jax.Array,  # [M, K] float32, or bfloat16 with K even
    w: jax.Array,  # [P, K, PANEL] x's dtype: packed column panels (bfloat16: rows paired)
    out_features: int,  # N, (P - 1) * PANEL < N <= P * PANEL
    num_rows: jax.Array | None = None,  # [] int32: rows past it are padding (zeros out)
    silu_mul: bool = False,  # w interleaves gate/up half-panels; y = silu(gate) * up
    float32_out: bool = False,  # bfloat16 x: return the float32 sums unrounded
) -> jax.Array:  # [M, N] x's dtype, or float32
    """x @ W with W packed in column panels: packed_matmul.cc in float32,
    bf16_matmul.cc in bfloat16 (float32 accumulation, one rounding, or none
    with float32_out: a row-parallel shard's partial sum is rounded once,
    after the shards are added)."""
    if x.dtype == jnp.float32:
        target, dtype = MATMUL_TARGET, x.dtype
    else:
        target = BF16_F32_TARGET if float32_out else BF16_TARGET
        dtype = jnp.dtype(jnp.float32) if float32_out else x.dtype
    out = jax.ShapeDtypeStruct((x.shape[0], out_features), dtype)
    rows = jnp.asarray(x.shape[0] if num_rows is None else num_rows, jnp.int32)
    return jax.ffi.ffi_call(target, out)(x, w, rows, silu_mul=silu_mul)


def attention_kernel_serves(dtype: jnp.dtype | str) -> bool:
    """True when the paged-attention kernel takes a cache of this dtype here:
    XLA:CPU, the library built, float32 or bfloat16 (a bfloat16 cache is
    widened as it is read, which needs no bfloat16 arithmetic from the CPU)."""
    return (jax.default_backend() == "cpu"
            and jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
            and kernel_available())


def coded_matmul_kernel(
    x: jax.Array,  # [M, K] float32, or bfloat16 (a CPU with native bfloat16 dot products)
    codes: jax.Array,  # [P, K, 16] (bits 4) or [P, K, 32] (bits 8) uint8
    scale: jax.Array,  # [P, K / 32, PANEL] float32
    offset: jax.Array,  # [P, K / 32, PANEL] float32
    out_features: int,
    bits: int,
    num_rows: jax.Array | None = None,  # [] int32: rows past it are padding (zeros out)
    silu_mul: bool = False,
    float32_out: bool = False,  # bfloat16 x: return the float32 sums unrounded
) -> jax.Array:  # [M, N] x's dtype, or float32
    """x @ W with W as integer codes in column panels: coded_matmul.cc in
    float32, coded_bf16_matmul.cc in bfloat16 (dot products of the codes
    themselves, the blocks' scales applied to the sums, one rounding, or
    none with float32_out)."""
    if x.dtype == jnp.bfloat16:
        target = CODED_BF16_F32_TARGET if float32_out else CODED_BF16_TARGET
        dtype = jnp.float32 if float32_out else jnp.bfloat16
    else:
        target, dtype = CODED_TARGET, jnp.float32
    out = jax.ShapeDtypeStruct((x.shape[0], out_features), dtype)
    rows = jnp.asarray(x.shape[0] if num_rows is None else num_rows, jnp.int32)
    return jax.ffi.ffi_call(target, out)(x, codes, scale, offset, rows,
                                               silu_mul=silu_mul, bits=np.int64(bits))


def widened_matmul_kernel(
    x: jax.Array,  # [M, K] float32
    w: jax.Array,  # [P, K, PANEL] bfloat16: the float32 panels' layout
    out_features: int,
    num_rows: jax.Array | None = None,  # [] int32: rows past it are padding (zeros out)
    silu_mul: bool = False,
) -> jax.Array:  # [M, N] float32
    """x @ W in float32 with W's bfloat16 panels widened in registers (see
    widened_matmul.cc): the float32 panel kernel's result on the upcast W."""
    out = jax.ShapeDtypeStruct((x.shape[0], out_features), jnp.float32)
    rows = jnp.asarray(x.shape[0] if num_rows is None else num_rows, jnp.int32)
    return jax.ffi.ffi_call(WIDENED_TARGET, out)(x, w, rows, silu_mul=silu_mul)
