"""Reading a step's device results on the host, on one host or several.

With one process every array is addressable and np.asarray reads it. On a
multi-host mesh a result spans other processes' devices: a replicated one
(the sampled tokens, as the steps leave them) is read from a local copy;
anything else is gathered, a collective every host runs at the same point
of the same step (they run the same collect code).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["to_host"]


def to_host(array: jax.Array) -> np.ndarray:
    """The whole array as numpy, wherever its shards live."""
    if not isinstance(array, jax.Array) or array.is_fully_addressable:
        return np.asarray(array)
    if array.sharding.is_fully_replicated:
        return np.asarray(array.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
