"""eSurge: a continuous-batching LLM inference engine in JAX/Flax.

`eSurge` is imported lazily so that the pure-Python layers (config, core,
scheduler) can be used without importing JAX.
"""

from typing import TYPE_CHECKING, Any

from esurge.config import CacheConfig, Config, ParallelConfig, SchedulerConfig, SpeculativeConfig
from esurge.sampling_params import SamplingParams
from esurge.settings import EngineSettings
from esurge.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from esurge.engine.api import eSurge
    from esurge.engine.request_output import CompletionOutput, RequestOutput

__all__ = [
    "CacheConfig",
    "CompletionOutput",
    "Config",
    "EngineSettings",
    "ParallelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutputsParams",
    "eSurge",
]
__version__ = "0.1.0"

_LAZY = {
    "eSurge": "esurge.engine.api",
    "RequestOutput": "esurge.engine.request_output",
    "CompletionOutput": "esurge.engine.request_output",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'esurge' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
