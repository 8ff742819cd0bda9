"""The CPU matmul kernels against XLA's matmul, by row count, at a model's own shapes.

For each projection of the model (fused q/k/v, o, the SiLU-gated gate/up,
down) and each row count M in --rows, one jitted call of

- the float32 panel kernel (packed_matmul.cc) on M real rows,
- the coded kernel (coded_matmul.cc) on M real rows of random 4-bit codes
  (where the input width is a multiple of 32, as GGUF blocks need),
- XLA's matmul on the plain input-major float32 weight, M rows,

median milliseconds of --repeats calls (interleaved, so drift hits all three
alike), and the kernel / XLA ratio. Where the CPU lacks AVX-512 the engine
keeps both layouts and sends buckets past packed_linear.DUAL_KERNEL_MAX_ROWS
to XLA; this is the measurement that threshold rests on. Prints the CPU's
vector features first: the kernels' register tiles differ with AVX-512.

    .venv/bin/python bench/kernel_rows.py [--model smollm2|tiny|150m] [--rows 1,2,4,16,32,64,128]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (hidden, heads, kv_heads, head_dim, intermediate)
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "smollm2": (576, 9, 3, 64, 1536),
    "tiny": (256, 4, 2, 64, 688),
    "150m": (1024, 16, 8, 64, 2816),
}


def projections(model: str) -> list[tuple[str, int, int, bool]]:
    """(name, in, out, silu-gated) of one decoder layer."""
    hidden, heads, kv_heads, head_dim, inter = SHAPES[model]
    return [("qkv", hidden, (heads + 2 * kv_heads) * head_dim, False),
            ("o", heads * head_dim, hidden, False),
            ("gate/up", hidden, inter, True),
            ("down", inter, hidden, False)]


def xla_matmul(x: Any, w: Any, n: int, silu: bool) -> Any:
    """XLA's product on the plain weight [in, out] (gate/up: silu(gate) * up)."""
    y = x @ w
    if not silu:
        return y
    import jax

    return jax.nn.silu(y[:, :n]) * y[:, n:]


def ready(fn: Callable[..., Any], *args: Any) -> None:
    """Call fn and wait for its result."""
    fn(*args).block_until_ready()


def median_ms(calls: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median wall time of each call, the calls interleaved."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            times[i].append(time.perf_counter() - start)
    return [1000 * statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--rows", default="1,2,4,16,32,64,128")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from esurge.models.cpu_kernels import (
        PANEL,
        coded_matmul_kernel,
        cpu_has_avx512,
        kernel_available,
        packed_matmul_kernel,
    )
    from esurge.models.packed_linear import DUAL_KERNEL_MAX_ROWS, pack_gate_up, pack_weight

    if not kernel_available():
        raise SystemExit("the CPU kernels are not available here (no compiler?)")
    print(f"AVX-512: {cpu_has_avx512()}; DUAL_KERNEL_MAX_ROWS = {DUAL_KERNEL_MAX_ROWS}; "
          f"model {args.model}; ms, median of {args.repeats}")
    print(f"{'projection':>10} {'rows':>5} {'panels':>8} {'coded':>8} {'xla':>8} "
          f"{'panels/xla':>10} {'coded/xla':>9}")
    rng = np.random.default_rng(0)
    for name, k, n, silu in projections(args.model):
        width = 2 * n if silu else n
        plain = jnp.asarray(rng.standard_normal((k, width), np.float32) / k ** 0.5)
        panels = pack_gate_up(plain, n) if silu else pack_weight(plain)
        num_panels = -(-n // (PANEL // 2 if silu else PANEL))
        coded = k % 32 == 0
        codes = jnp.asarray(rng.integers(0, 256, (num_panels, k, PANEL // 2), dtype=np.uint8))
        scale = jnp.asarray(rng.standard_normal((num_panels, k // 32, PANEL), np.float32) / 64)
        packed_fn = jax.jit(lambda x, w, r, n=n, silu=silu: packed_matmul_kernel(
            x, w, n, r, silu_mul=silu))
        coded_fn = jax.jit(lambda x, q, s, r, n=n, silu=silu: coded_matmul_kernel(
            x, q, s, s, n, 4, r, silu_mul=silu))
        xla_fn = jax.jit(functools.partial(xla_matmul, n=n, silu=silu))
        for m in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))
            rows = jnp.int32(m)
            calls = [functools.partial(ready, packed_fn, x, panels, rows),
                     functools.partial(ready, xla_fn, x, plain)]
            if coded:
                calls.append(functools.partial(ready, coded_fn, x, codes, scale, rows))
            for call in calls:
                call()  # compile
            t = median_ms(calls, args.repeats)
            coded_ms = f"{t[2]:8.3f}" if coded else f"{'-':>8}"
            coded_ratio = f"{t[2] / t[1]:9.2f}" if coded else f"{'-':>9}"
            print(f"{name:>10} {m:>5} {t[0]:8.3f} {coded_ms} {t[1]:8.3f} "
                  f"{t[0] / t[1]:10.2f} {coded_ratio}", flush=True)


if __name__ == "__main__":
    main()
