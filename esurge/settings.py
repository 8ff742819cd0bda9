"""How this process runs the engine: the settings beside the seed's `Config`.

The seed's `Config` family keeps exactly its fields; what only concerns the
way one process runs the model (its dtype, its share of memory, its
smallest step and its decode bursts) lives here, validated in one place.
`eSurge` keyword arguments and `esurge-serve` flags both reach the engine
through `EngineSettings.with_overrides`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from importlib import metadata

from esurge.config import CacheConfig, Config, ParallelConfig, SchedulerConfig
from esurge.errors import InvalidConfigError

__all__ = ["SERVING_DTYPES", "SPECULATION_MODES", "EngineSettings", "derived_budget",
           "derived_config", "expected_backend"]

# The dtypes a model can be served in; "auto" lets the loader choose.
SERVING_DTYPES = ("float32", "bfloat16")
# With a draft head: speculate where it measurably pays, or on every step.
SPECULATION_MODES = ("adaptive", "always")


# (max_num_seqs, max_num_batched_tokens) of a config derived for a backend
# (`eSurge` without a Config, `esurge-serve` without the flags). On a CPU a
# step's matmuls are compute-bound well below 256 rows, and every larger
# token bucket is one more warm-up program that runs a padding step of its
# size (a 2048-token one takes seconds on 2 cores); accelerators take the
# larger steps.
_DERIVED_BUDGETS = {"cpu": (16, 256)}
_ACCELERATOR_BUDGET = (32, 2048)


def derived_budget(backend: str) -> tuple[int, int]:
    """(requests, tokens per step) a derived config uses on a JAX backend name."""
    return _DERIVED_BUDGETS.get(backend, _ACCELERATOR_BUDGET)


def derived_config(max_model_len: int, backend: str, max_num_seqs: int | None = None
                   ) -> Config:
    """The config used when none is given (`eSurge(M)`, `esurge-serve` without
    engine flags): the context length, chunked prefill, async scheduling (the
    next step prepared while one runs; same tokens), the backend's budget
    (`derived_budget`; max_num_seqs overrides its request count) and a
    memory-sized cache with prefix caching."""
    seqs, tokens = derived_budget(backend)
    return Config(
        scheduler_config=SchedulerConfig(
            max_num_seqs=seqs if max_num_seqs is None else max_num_seqs,
            max_num_batched_tokens=min(tokens, max_model_len), max_model_len=max_model_len,
            chunked_prefill_enabled=True, async_scheduling=True),
        cache_config=CacheConfig(num_pages=None, page_size=16, enable_prefix_caching=True),
    )


# Accelerator plugins whose presence makes JAX pick a non-CPU backend by
# default; read from the installed distributions, so that choosing the
# derived budget initialises no JAX backend (a multi-host server must join
# its cluster first).
_ACCELERATOR_PLUGINS = {"jax-cuda12-plugin": "gpu", "jax-cuda13-plugin": "gpu",
                        "jax-rocm60-plugin": "gpu", "libtpu": "tpu"}


def expected_backend() -> str:
    """The JAX backend this process will use, without initialising JAX:
    JAX_PLATFORMS' first entry, else an installed accelerator plugin's, else "cpu"."""
    platforms = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip()
    if platforms:
        return {"cuda": "gpu", "rocm": "gpu"}.get(platforms, platforms)
    for dist, backend in _ACCELERATOR_PLUGINS.items():
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return backend
    return "cpu"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Engine settings outside the seed's `Config`.

    dtype: "auto" (the checkpoint's precision where this backend runs it on
    a fast path; see `esurge.models.loader.resolve_dtype`) or one of
    SERVING_DTYPES.
    memory_fraction: the share of free device memory the KV cache may take
    when `CacheConfig.num_pages` is not set.
    min_token_bucket: the smallest token bucket a step is padded to.
    decode_steps: decode iterations one step may run when every running
    request decodes without per-token sampling state (1: never a burst).
    speculation: with a draft head (SpeculativeConfig), "adaptive" drafts
    only at batch sizes where the measured token rate of speculative steps
    beats plain ones (esurge.spec_decode.policy); "always" drafts on every
    step. Either way the tokens are those of plain decoding (greedy) or its
    distribution (sampling).
    kv_cache_dtype: "auto" (the serving dtype) or one of SERVING_DTYPES; a
    bfloat16 cache under a float32 model halves the cache's memory and the
    bytes attention reads, its keys and values rounded once when written
    (attention itself stays float32).
    parallel_config: the devices the model is split over (ParallelConfig).
    """

    dtype: str = "auto"
    memory_fraction: float = 0.25
    min_token_bucket: int = 16
    decode_steps: int = 1
    kv_cache_dtype: str = "auto"
    speculation: str = "adaptive"
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.parallel_config, ParallelConfig):
            raise InvalidConfigError("parallel_config", f"parallel_config must be a "
                                     f"ParallelConfig, got {self.parallel_config!r}")
        if self.dtype not in ("auto", *SERVING_DTYPES):
            raise InvalidConfigError("dtype", f"dtype must be 'auto' or one of "
                                              f"{list(SERVING_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", *SERVING_DTYPES):
            raise InvalidConfigError(
                "kv_cache_dtype", f"kv_cache_dtype must be 'auto' or one of "
                                  f"{list(SERVING_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.speculation not in SPECULATION_MODES:
            raise InvalidConfigError("speculation", f"speculation must be one of "
                                     f"{list(SPECULATION_MODES)}, got {self.speculation!r}")
        fraction = self.memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
                0.0 < fraction <= 1.0):
            raise InvalidConfigError("memory_fraction",
                                     f"memory_fraction must be in (0, 1], got {fraction!r}")
        for name in ("min_token_bucket", "decode_steps"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise InvalidConfigError(name, f"{name} must be an int >= 1, got {value!r}")

    def with_overrides(self, **changes: object) -> EngineSettings:
        """These settings with every change that is not None applied (and validated)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"EngineSettings has no field(s) {sorted(unknown)}")
        given = {name: value for name, value in changes.items() if value is not None}
        return dataclasses.replace(self, **given) if given else self  # type: ignore[arg-type]

    def cache_dtype(self, serving_dtype: str) -> str:
        """The KV cache's dtype under a model served in serving_dtype."""
        return serving_dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def check_speculation(self, num_speculative_tokens: int) -> None:
        """Refuse decode bursts together with speculative decoding."""
        if self.decode_steps > 1 and num_speculative_tokens:
            raise InvalidConfigError(
                "decode_steps",
                f"decode_steps={self.decode_steps} with speculative decoding "
                f"(num_speculative_tokens={num_speculative_tokens}) is not supported: a step "
                "either verifies drafts or runs a decode burst")
