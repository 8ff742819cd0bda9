"""eSurge: a continuous-batching LLM inference engine in JAX/Flax."""

from esurge.config import CacheConfig, Config, SchedulerConfig, SpeculativeConfig
from esurge.sampling_params import SamplingParams

__all__ = ["CacheConfig", "Config", "SamplingParams", "SchedulerConfig", "SpeculativeConfig"]
__version__ = "0.1.0"
