"""bfloat16 on the CPU's own bfloat16 dot products (cpu_kernels/bf16_matmul.cc,
and the paged-attention kernel over a bfloat16 cache).

Tolerances: the kernels multiply bfloat16 values exactly and accumulate in
float32, then round once to bfloat16, so a matmul is within half a bfloat16
unit (2^-8 relative) of the float32 product of the same bfloat16 values, plus
float32 accumulation noise. A whole model also rounds its activations to
bfloat16 between layers (as transformers does in bfloat16), so its logits are
compared with the float32 computation on the same bfloat16 weights within 5%
of the logits' range, and its greedy tokens must equal float32's except where
float32's own top two logits are closer than that (a near-tie).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from esurge.models import cpu_kernels, load_model, packed_linear
from esurge.models.loader import LoadedModel
from esurge.models.packed_linear import pack_gate_up, pack_weight, packed_matmul, packed_silu_mul
from esurge.models.paged_attention import AttentionBackend, AttentionMetadata, write_and_attend
from tests.models.checkpoints import build_model, hf_config, save_checkpoint
from tests.models.conftest import FAMILIES
from tests.models.gguf_export import export_gguf
from tests.models.paged import PagedSession, Row, greedy_generate
from tests.models.test_paged_attention import (
    DIM,
    HEADS,
    KV_HEADS,
    build_case,
    dense_reference,
    fill_cache,
)

native = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not cpu_kernels.cpu_has_bf16_dot(),
    reason="this CPU has no AVX512_BF16: bfloat16 checkpoints are served in float32 here "
           "(test_auto_dtype_without_native_bfloat16_is_float32 covers that)")

# Within half a bfloat16 unit of the float32 result, plus accumulation noise.
HALF_UNIT = 2.0 ** -8
LOGIT_RANGE_FRACTION = 0.05


def _bf16(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def _assert_rounded_from(got: jax.Array, want: np.ndarray, noise: float) -> None:
    """got (bfloat16) is want (float32) rounded once, give or take noise."""
    got32 = np.asarray(got.astype(jnp.float32))
    bound = HALF_UNIT * np.abs(want) + noise
    worst = float(np.max(np.abs(got32 - want) - bound))
    assert worst <= 0, f"off by {worst} beyond half a bfloat16 unit"


# (rows in the bucket, real rows, K, N): few rows (AVX512_BF16 tiles), 8 and
# more (AMX where present), a K that AMX's 32-wide tiles do not divide, and N
# that leaves a partial last panel.
# (32, 29, 200, 70): a decode-sized item goes through its inputs in blocks of 32
# pairs (100 pairs: three whole blocks and 4), every row tile per block (three
# of 8 rows and one of 5).
SHAPES = [(1, 1, 64, 40), (16, 3, 576, 1536), (16, 16, 576, 1536), (37, 37, 96, 100),
          (300, 261, 256, 700), (64, 50, 40, 70), (32, 29, 200, 70)]


@native
@pytest.mark.usefixtures("cpu_kernels_built")
@pytest.mark.parametrize(("m", "rows", "k", "n"), SHAPES)
def test_matmul_is_the_float32_product_rounded_once(m: int, rows: int, k: int, n: int) -> None:
    rng = np.random.default_rng(m + k + n)
    x, w = _bf16(rng, m, k), _bf16(rng, k, n, scale=k ** -0.5)
    want = np.asarray(x.astype(jnp.float32) @ w.astype(jnp.float32))
    noise = 1e-5 * float(np.abs(np.asarray(x, np.float32)).max()) * k ** 0.5
    got = jax.jit(lambda a, b, r: packed_matmul(a, b, n, r))(x, pack_weight(w), jnp.int32(rows))
    assert got.dtype == jnp.bfloat16
    _assert_rounded_from(got[:rows], want[:rows], noise)
    assert np.all(np.asarray(got[rows:].astype(jnp.float32)) == 0)  # padding rows: zeros


@native
@pytest.mark.usefixtures("cpu_kernels_built")
@pytest.mark.parametrize(("m", "rows", "k", "n"), [SHAPES[0], SHAPES[2], SHAPES[4]])
def test_float32_results_are_the_sums_the_bfloat16_results_round(m: int, rows: int, k: int,
                                                                  n: int) -> None:
    # What a row-parallel shard returns: its partial sum, not yet rounded.
    rng = np.random.default_rng(3 * m + n)
    x, w = _bf16(rng, m, k), _bf16(rng, k, n, scale=k ** -0.5)
    want = np.asarray(x.astype(jnp.float32) @ w.astype(jnp.float32))
    noise = 1e-5 * float(np.abs(np.asarray(x, np.float32)).max()) * k ** 0.5
    panels, num_rows = pack_weight(w), jnp.int32(rows)
    wide = jax.jit(lambda a, b, r: cpu_kernels.packed_matmul_kernel(a, b, n, r,
                                                                    float32_out=True))(
        x, panels, num_rows)
    rounded = jax.jit(lambda a, b, r: cpu_kernels.packed_matmul_kernel(a, b, n, r))(
        x, panels, num_rows)
    assert wide.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(wide[:rows]), want[:rows], rtol=1e-5, atol=noise)
    np.testing.assert_array_equal(np.asarray(wide.astype(jnp.bfloat16)), np.asarray(rounded))
    assert np.all(np.asarray(wide[rows:]) == 0)  # padding rows: zeros


@native
@pytest.mark.usefixtures("cpu_kernels_built")
@pytest.mark.parametrize(("m", "rows", "k", "n"), SHAPES)
def test_gated_matmul_applies_silu_to_the_float32_accumulators(m: int, rows: int, k: int,
                                                               n: int) -> None:
    rng = np.random.default_rng(7 * m + k)
    x, w = _bf16(rng, m, k), _bf16(rng, k, 2 * n, scale=k ** -0.5)
    both = np.asarray(x.astype(jnp.float32) @ w.astype(jnp.float32))
    want = np.asarray(jax.nn.silu(both[:, :n]) * both[:, n:])
    got = jax.jit(lambda a, b, r: packed_silu_mul(a, b, n, r))(x, pack_gate_up(w, n),
                                                              jnp.int32(rows))
    _assert_rounded_from(got[:rows], want[:rows], 1e-4)
    assert np.all(np.asarray(got[rows:].astype(jnp.float32)) == 0)


def test_bfloat16_panels_pair_their_input_rows_and_the_xla_path_undoes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The layout is the same on every machine; only the kernel needs the CPU.
    rng = np.random.default_rng(3)
    w = _bf16(rng, 6, 33)
    packed = np.asarray(pack_weight(w).astype(jnp.float32))  # [2, 6, 32]
    plain = np.asarray(pack_weight(w.astype(jnp.float32)))
    np.testing.assert_array_equal(packed[:, :2].reshape(2, -1),
                                  np.stack([plain[:, 0], plain[:, 1]], -1).reshape(2, -1))
    monkeypatch.setattr(packed_linear, "kernels_serve", lambda dtype: False)
    x = _bf16(rng, 4, 6)
    want = np.asarray(x.astype(jnp.float32) @ w.astype(jnp.float32))
    _assert_rounded_from(packed_matmul(x, pack_weight(w), 33), want, 1e-5)
    with pytest.raises(ValueError, match="even input width"):
        pack_weight(_bf16(rng, 5, 8))


def _attend(backend: AttentionBackend, case: dict, k_cache: jax.Array, v_cache: jax.Array,
            new: tuple[np.ndarray, np.ndarray], slots: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    metadata = AttentionMetadata(jnp.asarray(case["positions"]), jnp.asarray(case["token_req"]),
                                 jnp.asarray(case["tables"]), jnp.asarray(case["num_tokens"]))
    step = jax.jit(functools.partial(write_and_attend, scale=DIM ** -0.5, backend=backend),
                   donate_argnums=(3, 4))
    out, k_new, v_new = step(jnp.asarray(case["q"]), jnp.asarray(new[0]), jnp.asarray(new[1]),
                             k_cache.astype(jnp.bfloat16), v_cache.astype(jnp.bfloat16),
                             jnp.asarray(slots), metadata)
    return (np.asarray(out), np.asarray(k_new.astype(jnp.float32)),
            np.asarray(v_new.astype(jnp.float32)))


@native
@pytest.mark.usefixtures("cpu_kernels_built")
def test_attention_over_a_bfloat16_cache_matches_the_xla_path() -> None:
    case, keys, values = build_case(seed=21)
    rng = np.random.default_rng(4)
    t, num = case["q"].shape[0], int(case["num_tokens"])
    new = (rng.standard_normal((t, KV_HEADS, DIM)).astype(np.float32),
           rng.standard_normal((t, KV_HEADS, DIM)).astype(np.float32))
    slots = np.zeros(t, np.int32)
    for row in range(num):
        r, pos = case["token_req"][row], case["positions"][row]
        slots[row] = case["tables"][r][pos // 4] * 4 + pos % 4
    kern = _attend(AttentionBackend.CPU_KERNEL, case, *fill_cache(case, keys, values), new, slots)
    xla = _attend(AttentionBackend.XLA, case, *fill_cache(case, keys, values), new, slots)
    # Both store the new keys rounded to bfloat16 (nearest even): the same bits.
    np.testing.assert_array_equal(kern[1], xla[1])
    np.testing.assert_array_equal(kern[2], xla[2])
    # Softmax and the weighted sum run in float32 on the widened cache: dense
    # float32 attention over the bfloat16-rounded keys and values. (The XLA
    # path rounds the probabilities to the cache dtype before the weighted sum,
    # so it is only within ~2^-9 of this.)
    def rounded(a: np.ndarray) -> np.ndarray:
        return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32))

    for row in range(num):
        r, pos = case["token_req"][row], case["positions"][row]
        keys[r][pos], values[r][pos] = new[0][row], new[1][row]
    for row in range(num):
        r, pos = case["token_req"][row], case["positions"][row]
        want = dense_reference(case["q"][row], rounded(keys[r]), rounded(values[r]), pos,
                               None, None, None)
        np.testing.assert_allclose(kern[0][row], want, atol=2e-5, err_msg=f"row {row}")
    np.testing.assert_allclose(kern[0][:num], xla[0][:num], atol=HALF_UNIT)
    assert np.all(kern[0][num:] == 0.0)


@pytest.fixture(scope="module")
def bf16_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            model = build_model(hf_config(family), seed=1).to(torch.bfloat16)
            made[family] = save_checkpoint(model, tmp_path_factory.mktemp(f"bf16-{family}"))
        return made[family]

    return make


def _assert_follows(ours: LoadedModel, reference: LoadedModel) -> None:
    """ours' logits within LOGIT_RANGE_FRACTION of reference's range, and its greedy
    tokens equal reference's except at near-ties."""
    ids = [int(t) for t in np.random.default_rng(2).integers(3, 250, 17)]
    got, want = (PagedSession(m).step([Row("r", ids, 0, len(ids))])[0] for m in (ours, reference))
    # The LM head's float32 sums, not rounded to bfloat16 (where near-ties tie).
    assert np.any(got != np.asarray(jnp.asarray(got).astype(jnp.bfloat16).astype(jnp.float32)))
    spread = float(want.max() - want.min())
    np.testing.assert_allclose(got, want, atol=LOGIT_RANGE_FRACTION * spread)

    prompts = [ids[:9], ids[4:17], ids[2:6]]
    tokens = greedy_generate(PagedSession(ours), prompts, 12)
    expected = greedy_generate(PagedSession(reference), prompts, 12)
    for prompt, mine, theirs in zip(prompts, tokens, expected, strict=True):
        if mine == theirs:
            continue
        at = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
        logits = PagedSession(reference).step(
            [Row("t", prompt + theirs[:at], 0, len(prompt) + at)])[0][-1]
        margin = float(logits[theirs[at]] - logits[mine[at]])
        assert margin <= LOGIT_RANGE_FRACTION * spread, (
            f"token {at} differs ({mine[at]} vs {theirs[at]}) though float32 prefers "
            f"{theirs[at]} by {margin:.3f}, not a near-tie")


@native
@pytest.mark.usefixtures("cpu_kernels_built")
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_in_bfloat16_follows_float32_on_the_same_weights(
        family: str, bf16_checkpoints: Callable[[str], Path]) -> None:
    path = bf16_checkpoints(family)
    ours = load_model(path)  # auto: native bfloat16 on this CPU
    reference = load_model(path, "float32")  # the same bfloat16 values, upcast
    assert ours.dtype == "bfloat16" and ours.config.packed_weights
    # A tied head (qwen2 here) gets bfloat16 panels of its own.
    assert ours.config.packed_tied_head == ours.config.tie_word_embeddings
    assert reference.dtype == "float32"
    _assert_follows(ours, reference)


@native
@pytest.mark.usefixtures("cpu_kernels_built")
@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0],
                         ids=lambda q: q.name)
def test_a_quantized_gguf_served_in_bfloat16_follows_its_float32_serving(
        qtype: gguf.GGMLQuantizationType, tmp_path: Path) -> None:
    # float32 serving multiplies the file's codes with float32 activations;
    # bfloat16 serving multiplies the same codes with bfloat16 ones
    # (coded_bf16_matmul.cc), except beside AMX tiles, where it dequantizes
    # them at load into bfloat16 panels.
    save_checkpoint(build_model(hf_config("llama"), seed=1), tmp_path / "hf")
    path = export_gguf(tmp_path / "hf", "llama", tmp_path / "m.gguf", qtype=qtype)
    ours, reference = load_model(path, "bfloat16"), load_model(path, "float32")
    assert ours.dtype == "bfloat16" and ours.config.packed_weights
    assert reference.config.coded_weights
    assert ours.config.coded_weights == (() if cpu_kernels.cpu_has_amx()
                                         else reference.config.coded_weights)
    _assert_follows(ours, reference)


@native
def test_auto_dtype_serves_bfloat16_natively_and_says_why(
        bf16_checkpoints: Callable[[str], Path]) -> None:
    loaded = load_model(bf16_checkpoints("llama"), fuse=False)
    assert loaded.dtype == "bfloat16"
    assert loaded.dtype_reason.startswith("bfloat16 checkpoint; this CPU's native bfloat16")


def test_auto_dtype_without_native_bfloat16_is_float32(
        monkeypatch: pytest.MonkeyPatch, bf16_checkpoints: Callable[[str], Path]) -> None:
    monkeypatch.setenv("ESURGE_BF16_KERNELS", "0")  # as on a CPU without AVX512_BF16
    loaded = load_model(bf16_checkpoints("llama"), fuse=False)
    assert loaded.dtype == "float32"
    assert loaded.dtype_reason.startswith("bfloat16 checkpoint upcast")


@native
@pytest.mark.usefixtures("cpu_kernels_built")
def test_decode_rows_of_many_requests_over_a_bfloat16_cache() -> None:
    """40 one-row requests: enough query blocks that the kernel takes every kv
    head of a block in one pass (read in cache order), not one head at a time."""
    rng = np.random.default_rng(9)
    rows, page, max_pages = 40, 4, 6
    num_pages = rows * max_pages + 1
    lengths = rng.integers(1, page * max_pages + 1, rows)
    tables = (1 + rng.permutation(num_pages - 1)[:rows * max_pages]).reshape(rows, max_pages)
    keys = rng.standard_normal((rows, page * max_pages, KV_HEADS, DIM)).astype(np.float32)
    values = rng.standard_normal((rows, page * max_pages, KV_HEADS, DIM)).astype(np.float32)
    k_cache = np.full((num_pages, page, KV_HEADS, DIM), 7.0, np.float32)
    v_cache = np.full((num_pages, page, KV_HEADS, DIM), -7.0, np.float32)
    for r in range(rows):
        pos = np.arange(lengths[r] - 1)  # the last position is this step's new key
        k_cache[tables[r][pos // page], pos % page] = keys[r, pos]
        v_cache[tables[r][pos // page], pos % page] = values[r, pos]
    positions = (lengths - 1).astype(np.int32)
    slots = (tables[np.arange(rows), positions // page] * page + positions % page).astype(np.int32)
    q = rng.standard_normal((rows, HEADS, DIM)).astype(np.float32)
    new_k, new_v = keys[np.arange(rows), positions], values[np.arange(rows), positions]
    out, _, _ = cpu_kernels.paged_attention_kernel(
        jnp.asarray(q), jnp.asarray(new_k), jnp.asarray(new_v), jnp.asarray(slots),
        jnp.asarray(k_cache, jnp.bfloat16), jnp.asarray(v_cache, jnp.bfloat16),
        jnp.asarray(positions), jnp.arange(rows, dtype=jnp.int32),
        jnp.asarray(tables, jnp.int32), jnp.int32(rows), scale=DIM ** -0.5,
        sliding_window=None, chunk_size=None, softcap=None)

    def rounded(a: np.ndarray) -> np.ndarray:
        return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32))

    for r in range(rows):
        n = int(lengths[r])
        want = dense_reference(q[r], rounded(keys[r, :n]), rounded(values[r, :n]), n - 1,
                               None, None, None)
        np.testing.assert_allclose(np.asarray(out)[r], want, atol=2e-5, err_msg=f"row {r}")


@pytest.mark.usefixtures("cpu_kernels_built")
@pytest.mark.parametrize("dtype", [
    pytest.param("bfloat16", marks=native), "float32"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # head_dim 16 and 24 (a tail)
def test_a_position_scores_the_same_decoded_alone_or_verified_among_rows(
        dtype: str, family: str, bf16_checkpoints: Callable[[str], Path]) -> None:
    # A decode row's 2 query lanes score keys directly; 5 rows of one request
    # (a speculative step's verification) take the transposed key block. Both
    # must give the same bits: in bfloat16 the old transposed order moved
    # greedy tokens with speculation on.
    model = load_model(bf16_checkpoints(family), dtype)
    ids = [int(t) for t in np.random.default_rng(5).integers(3, 250, 15)]
    alone, together = PagedSession(model), PagedSession(model)
    alone.step([Row("r", ids[:10], 0)])
    one_by_one = [alone.step([Row("r", [ids[10 + i]], 10 + i)])[0][0] for i in range(5)]
    together.step([Row("r", ids[:10], 0)])
    verified = together.step([Row("r", ids[10:], 10, 5)])[0]
    for i in range(5):
        np.testing.assert_array_equal(verified[i], one_by_one[i], err_msg=f"position {10 + i}")
