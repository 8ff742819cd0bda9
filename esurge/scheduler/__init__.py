"""Request scheduling over the paged KV cache (pure Python, no JAX)."""

from esurge.scheduler.interface import SchedulerInterface
from esurge.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from esurge.scheduler.scheduler import Scheduler

__all__ = [
    "CachedRequestData",
    "NewRequestData",
    "Scheduler",
    "SchedulerInterface",
    "SchedulerOutput",
]
