"""The CPU paged-attention kernel against the dense reference and the XLA path.

The kernel writes the step's keys and values into the (donated) cache and
attends in one FFI call; every check here compares it with the pure-JAX
write_kv + paged_attention on the same inputs, and with dense attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from esurge.models import cpu_kernels
from esurge.models.paged_attention import AttentionBackend, AttentionMetadata, write_and_attend
from tests.models.test_paged_attention import (
    DIM,
    HEADS,
    KV_HEADS,
    NUM_PAGES,
    PAGE,
    build_case,
    dense_reference,
    fill_cache,
)

pytestmark = [pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU-only kernels"),
              pytest.mark.usefixtures("cpu_kernels_built")]


def _run(backend: AttentionBackend, case: dict, k_cache: jax.Array, v_cache: jax.Array,
         new_k: np.ndarray, new_v: np.ndarray, slots: np.ndarray, **mask: object
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    metadata = AttentionMetadata(jnp.asarray(case["positions"]), jnp.asarray(case["token_req"]),
                                 jnp.asarray(case["tables"]), jnp.asarray(case["num_tokens"]))
    step = jax.jit(functools.partial(write_and_attend, scale=DIM ** -0.5, backend=backend,
                                     **mask), donate_argnums=(3, 4))
    out, k_new, v_new = step(jnp.asarray(case["q"]), jnp.asarray(new_k), jnp.asarray(new_v),
                             k_cache, v_cache, jnp.asarray(slots), metadata)
    return np.asarray(out), np.asarray(k_new), np.asarray(v_new)


def _step_writes(case: dict, rng: np.random.Generator
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This step's new keys and values [T, KV, D] and their slots [T]: each real
    row writes its own position; padding rows write into the null page, as the
    runner does."""
    t = case["q"].shape[0]
    new_k = rng.standard_normal((t, KV_HEADS, DIM)).astype(np.float32)
    new_v = rng.standard_normal((t, KV_HEADS, DIM)).astype(np.float32)
    slots = np.zeros(t, np.int32)
    for row in range(int(case["num_tokens"])):
        r, pos = case["token_req"][row], case["positions"][row]
        slots[row] = case["tables"][r][pos // PAGE] * PAGE + pos % PAGE
    return new_k, new_v, slots


@pytest.mark.parametrize(("window", "chunk", "softcap"), [
    (None, None, None), (5, None, None), (None, 6, None), (None, None, 1.5), (9, None, 2.0),
])
def test_kernel_matches_xla_and_dense(window: int | None, chunk: int | None,
                                      softcap: float | None) -> None:
    case, keys, values = build_case(seed=11)
    num = int(case["num_tokens"])
    new_k, new_v, slots = _step_writes(case, np.random.default_rng(5))
    for row in range(num):  # what the dense reference must see
        r, pos = case["token_req"][row], case["positions"][row]
        keys[r][pos], values[r][pos] = new_k[row], new_v[row]
    mask = {"sliding_window": window, "chunk_size": chunk, "softcap": softcap}
    results = {}
    for backend in (AttentionBackend.CPU_KERNEL, AttentionBackend.XLA):
        k_cache, v_cache = fill_cache(case, keys, values)
        results[backend] = _run(backend, case, k_cache, v_cache, new_k, new_v, slots, **mask)
    kern, xla = results[AttentionBackend.CPU_KERNEL], results[AttentionBackend.XLA]
    np.testing.assert_allclose(kern[0][:num], xla[0][:num], atol=2e-6)
    np.testing.assert_array_equal(kern[1], xla[1])  # identical caches after the write
    np.testing.assert_array_equal(kern[2], xla[2])
    assert np.all(kern[0][num:] == 0.0)  # padding rows come back as zeros
    for row in range(num):
        r, pos = case["token_req"][row], case["positions"][row]
        want = dense_reference(case["q"][row], keys[r], values[r], pos, window, chunk, softcap)
        np.testing.assert_allclose(kern[0][row], want, atol=2e-5, err_msg=f"row {row}")


def test_fused_rope_equals_rotating_first() -> None:
    # The kernel rotates q and the new k itself when given the tables; the XLA
    # path applies apply_rope first. Both must agree, on the output and on the
    # keys written to the cache.
    case, keys, values = build_case(seed=12)
    rng = np.random.default_rng(9)
    num = int(case["num_tokens"])
    new_k, new_v, slots = _step_writes(case, rng)
    angles = np.outer(case["positions"], rng.uniform(0.01, 1.0, DIM // 2)).astype(np.float32)
    rope = (jnp.asarray(np.cos(np.concatenate([angles, angles], -1))),
            jnp.asarray(np.sin(np.concatenate([angles, angles], -1))))
    results = {}
    for backend in (AttentionBackend.CPU_KERNEL, AttentionBackend.XLA):
        k_cache, v_cache = fill_cache(case, keys, values)
        results[backend] = _run(backend, case, k_cache, v_cache, new_k, new_v, slots, rope=rope)
    kern, xla = results[AttentionBackend.CPU_KERNEL], results[AttentionBackend.XLA]
    np.testing.assert_allclose(kern[0][:num], xla[0][:num], atol=1e-5)
    np.testing.assert_allclose(kern[1], xla[1], atol=1e-6)
    np.testing.assert_array_equal(kern[2], xla[2])
    # and the rotation really happened: the unrotated run writes other keys
    plain = _run(AttentionBackend.CPU_KERNEL, case, *fill_cache(case, keys, values), new_k,
                 new_v, slots)
    assert np.abs(plain[1] - kern[1]).max() > 0.1


def test_invalid_slots_and_pages_never_touch_memory_outside_the_pool() -> None:
    case, keys, values = build_case(seed=3)
    case = dict(case, tables=np.where(case["tables"] > 0, case["tables"], 10_000))
    k_cache, v_cache = fill_cache(dict(case, tables=build_case(seed=3)[0]["tables"]), keys, values)
    t = case["q"].shape[0]
    zeros = np.zeros((t, KV_HEADS, DIM), np.float32)
    slots = np.full(t, NUM_PAGES * PAGE + 5, np.int32)  # out of range: ignored
    out, k_new, _ = _run(AttentionBackend.CPU_KERNEL, case, k_cache, v_cache, zeros, zeros,
                         slots)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(k_new, np.asarray(fill_cache(
        dict(case, tables=build_case(seed=3)[0]["tables"]), keys, values)[0]))


def test_explicit_kernel_backend_refuses_what_it_cannot_run() -> None:
    metadata = AttentionMetadata(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32),
                                 jnp.ones((1, 2), jnp.int32), jnp.int32(2))
    cache = jnp.zeros((4, PAGE, KV_HEADS, DIM), jnp.float16)  # no kernel serves float16
    new = jnp.zeros((2, KV_HEADS, DIM), jnp.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16 cache"):
        write_and_attend(jnp.zeros((2, HEADS, DIM), jnp.float16), new, new, cache, cache,
                         jnp.zeros(2, jnp.int32), metadata, scale=1.0,
                         backend=AttentionBackend.CPU_KERNEL)


def test_disabled_by_environment_uses_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESURGE_CPU_KERNELS", "0")
    assert cpu_kernels._load() is False


def test_missing_compiler_falls_back(monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-esurge")
    monkeypatch.delenv("ESURGE_CPU_KERNELS", raising=False)
    assert cpu_kernels._load() is False
    assert "no C++ compiler found" in caplog.text


def test_build_is_cached_per_source(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESURGE_KERNEL_CACHE", str(tmp_path))
    cxx = cpu_kernels.shutil.which("c++")
    assert cxx is not None
    first = cpu_kernels._build(cxx)
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels._build(cxx) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


@pytest.mark.parametrize("decode_rows", [0, 70])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(4, 4, 24), (8, 2, 64), (6, 3, 40), (4, 2, 128), (9, 3, 64)])
def test_kernel_matches_xla_across_head_shapes(heads: int, kv_heads: int, dim: int,
                                               decode_rows: int) -> None:
    # Head sizes with and without a 16-wide remainder (64 and 128 take unrolled
    # score loops), group sizes 1, 2, 3 (SmolLM2's: a decode row is a tile of 3
    # lanes) and 4; a 40-token prefill chunk spans three
    # query blocks and several key blocks, a decode row and a 3-token
    # verification row sit beside it. With 70 more decode rows there are enough
    # query blocks for the kernel to take all kv heads of a block in one item.
    rng = np.random.default_rng(dim)
    page, num_pages, max_pages = 8, 30 + 7 * decode_rows, 8
    steps = ((40, 0), (1, 33), (3, 17),  # (rows, first position) per request
             *((1, 3 + i % 50) for i in range(decode_rows)))
    tables = np.zeros((len(steps), max_pages), np.int32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    positions, token_req = [], []
    for r, (n, start) in enumerate(steps):
        for j in range(-(-(start + n) // page)):
            tables[r, j] = free.pop()
        positions += range(start, start + n)
        token_req += [r] * n
    t = len(positions) + 4  # padding rows
    positions += [0] * 4
    token_req += [0] * 4
    slots = np.array([tables[r][p // page] * page + p % page for r, p in
                      zip(token_req, positions, strict=True)], np.int32)
    slots[-4:] = 0
    metadata = AttentionMetadata(jnp.asarray(positions, jnp.int32),
                                 jnp.asarray(token_req, jnp.int32), jnp.asarray(tables),
                                 jnp.int32(t - 4))
    q = jnp.asarray(rng.standard_normal((t, heads, dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((t, kv_heads, dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((t, kv_heads, dim)), jnp.float32)
    k_cache = jnp.asarray(rng.standard_normal((num_pages, page, kv_heads, dim)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((num_pages, page, kv_heads, dim)), jnp.float32)
    outs = []
    for backend in (AttentionBackend.CPU_KERNEL, AttentionBackend.XLA):
        out, _, _ = jax.jit(functools.partial(write_and_attend, scale=dim ** -0.5,
                                              backend=backend))(
            q, k, v, k_cache, v_cache, jnp.asarray(slots), metadata)
        outs.append(np.asarray(out)[: t - 4])
    assert np.ptp(outs[1]) > 0.5
    np.testing.assert_allclose(outs[0], outs[1], atol=3e-6)
