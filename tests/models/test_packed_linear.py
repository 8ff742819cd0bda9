"""Packed projections: the CPU matmul kernel and the packed serving layout.

The kernel is checked against float64 numpy on shapes with and without
remainders (rows not a multiple of its 8-row tile or 256-row chunk, columns
not a multiple of the 32-column panel), against the XLA fallback, for padding
rows (zeros, not computed), and for the property the engine relies on: a
row's result does not depend on the rows beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from esurge.models import cpu_kernels, load_model, packed_linear
from esurge.models.decoder_config import (
    Activation,
    AttentionKind,
    DecoderConfig,
    LayerAttention,
    RopeConfig,
    RopeType,
)
from esurge.models.fusion import pack_per_shard
from esurge.models.local_shards import Split
from esurge.models.packed_linear import (
    PANEL,
    pack_gate_up,
    pack_weight,
    packed_matmul,
    packed_silu_mul,
)
from tests.models.conftest import Pair
from tests.models.paged import PagedSession, Row

pytestmark = [pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU-only kernels"),
              pytest.mark.usefixtures("cpu_kernels_built")]


def _operands(rows: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, k)).astype(np.float32),
            rng.standard_normal((k, n)).astype(np.float32))


def test_packing_is_column_panels_with_zero_padding() -> None:
    _, w = _operands(1, 9, 70)
    packed = np.asarray(pack_weight(jnp.asarray(w)))
    assert packed.shape == (3, 9, PANEL)
    np.testing.assert_array_equal(packed[0, :, :], w[:, :PANEL])
    np.testing.assert_array_equal(packed[2, :, : 70 - 2 * PANEL], w[:, 2 * PANEL:])
    assert not packed[2, :, 70 - 2 * PANEL:].any()
    unpacked = packed.transpose(1, 0, 2).reshape(9, 3 * PANEL)[:, :70]
    np.testing.assert_array_equal(unpacked, w)


@pytest.mark.parametrize(("rows", "k", "n"), [
    (1, 16, 32), (3, 17, 70), (8, 64, 96), (13, 256, 40), (32, 256, 512), (45, 33, 5),
    (256, 48, 64), (517, 40, 70),
])
def test_kernel_matches_float64_reference(rows: int, k: int, n: int) -> None:
    x, w = _operands(rows, k, n, seed=rows + k + n)
    got = np.asarray(jax.jit(packed_matmul, static_argnums=2)(
        jnp.asarray(x), pack_weight(jnp.asarray(w)), n))
    assert got.shape == (rows, n)
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(k))


def test_padding_rows_are_zeros_and_real_rows_unchanged() -> None:
    x, w = _operands(300, 24, 40, seed=6)
    packed = pack_weight(jnp.asarray(w))
    full = np.asarray(packed_matmul(jnp.asarray(x), packed, 40))
    for real in (0, 5, 261):
        part = np.asarray(jax.jit(packed_matmul, static_argnums=2)(
            jnp.asarray(x), packed, 40, jnp.int32(real)))
        np.testing.assert_array_equal(part[:real], full[:real])
        assert not part[real:].any()


def test_xla_fallback_gives_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = _operands(40, 24, 70, seed=4)
    packed = pack_weight(jnp.asarray(w))
    kernel = np.asarray(packed_matmul(jnp.asarray(x), packed, 70))
    monkeypatch.setattr(packed_linear, "kernels_serve", lambda dtype: False)
    lowered = jax.jit(packed_matmul, static_argnums=2).lower(jnp.asarray(x), packed, 70)
    assert cpu_kernels.MATMUL_TARGET not in lowered.as_text()
    xla = np.asarray(packed_matmul(jnp.asarray(x), packed, 70))
    np.testing.assert_allclose(xla, kernel, rtol=1e-5, atol=1e-5)


def _silu_mul_reference(x: np.ndarray, w: np.ndarray, inter: int) -> np.ndarray:
    gate_up = x.astype(np.float64) @ w.astype(np.float64)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    return gate / (1.0 + np.exp(-gate)) * up


@pytest.mark.parametrize(("rows", "k", "inter"), [(1, 16, 16), (13, 40, 70), (300, 24, 40)])
def test_silu_epilogue_matches_the_reference(rows: int, k: int, inter: int) -> None:
    x, w = _operands(rows, k, 2 * inter, seed=rows + inter)
    x[0, :] *= 30.0  # large gates on both sides: the sigmoid must not overflow
    packed = pack_gate_up(jnp.asarray(w), inter)
    assert packed.shape == (-(-inter // 16), k, PANEL)
    got = np.asarray(jax.jit(packed_silu_mul, static_argnums=2)(jnp.asarray(x), packed, inter))
    want = _silu_mul_reference(x, w, inter)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-4 * np.sqrt(k))
    part = np.asarray(packed_silu_mul(jnp.asarray(x), packed, inter, jnp.int32(rows // 2)))
    np.testing.assert_array_equal(part[:rows // 2], got[:rows // 2])
    assert not part[rows // 2:].any()


def test_silu_epilogue_xla_fallback_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = _operands(9, 24, 2 * 40, seed=2)
    packed = pack_gate_up(jnp.asarray(w), 40)
    kernel = np.asarray(packed_silu_mul(jnp.asarray(x), packed, 40))
    monkeypatch.setattr(packed_linear, "kernels_serve", lambda dtype: False)
    np.testing.assert_allclose(np.asarray(packed_silu_mul(jnp.asarray(x), packed, 40)), kernel,
                               rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_its_neighbours() -> None:
    x, w = _operands(32, 256, 96, seed=8)
    packed = pack_weight(jnp.asarray(w))
    batch = np.asarray(packed_matmul(jnp.asarray(x), packed, 96))
    for i in (0, 7, 8, 31):
        alone = np.asarray(packed_matmul(jnp.asarray(x[i:i + 1]), packed, 96))
        np.testing.assert_array_equal(batch[i], alone[0])


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 6, 7, 9, 32])
def test_row_tiles_give_the_products_of_rows_taken_one_at_a_time(rows: int) -> None:
    # Steps of several rows run other register tiles than a single row does
    # (with AVX2 only: half panels for every tile of 3 to 6 rows, whole panels
    # for 1 or 2); every product must be the same to the bit, SiLU epilogue
    # included.
    x, w = _operands(rows, 96, 140, seed=rows)
    packed, gate_up = pack_weight(jnp.asarray(w)), pack_gate_up(jnp.asarray(w), 70)
    for product in (partial(packed_matmul, packed=packed, out_features=140),
                    partial(packed_silu_mul, packed=gate_up, intermediate=70)):
        together = np.asarray(product(jnp.asarray(x)))
        one_by_one = np.concatenate([np.asarray(product(jnp.asarray(x[i:i + 1])))
                                     for i in range(rows)])
        np.testing.assert_array_equal(together, one_by_one)


def test_kernel_rejects_mismatched_shapes() -> None:
    x = jnp.zeros((4, 16), jnp.float32)
    packed = pack_weight(jnp.zeros((12, 64), jnp.float32))  # K = 12, not 16
    with pytest.raises(Exception, match="shapes do not match"):
        np.asarray(cpu_kernels.packed_matmul_kernel(x, packed, 64))


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])  # qkv biases; an untied LM head
def test_serving_load_packs_every_projection_and_keeps_the_logits(
        make_pair: Callable[..., Pair], family: str) -> None:
    pair = make_pair(family)
    loaded = pair.loaded
    assert loaded.config.packed_weights
    params = loaded.model_state.params
    hidden = loaded.config.hidden_size
    attn = params["model"]["layers"][0]["self_attn"]
    assert attn["o_proj"]["weight"].shape == (-(-hidden // PANEL), hidden, PANEL)
    gate_up = params["model"]["layers"][0]["mlp"]["gate_up_proj"]["weight"]
    inter = loaded.config.intermediate_size
    if loaded.config.fused_gate_activation:  # SiLU: gate/up half-panels, activation fused
        assert gate_up.shape == (-(-inter // 16), hidden, PANEL)
    else:  # GELU (gemma2): plain panels of the [2I] output
        assert gate_up.shape == (-(-2 * inter // PANEL), hidden, PANEL)
    if loaded.config.qkv_bias:  # biases stay [out]
        c = loaded.config
        assert attn["qkv_proj"]["bias"].shape == ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim,)
    if loaded.config.tie_word_embeddings:  # the head is the embedding table, unpacked
        assert "lm_head" not in params
    else:
        assert params["lm_head"]["weight"].shape == (-(-loaded.vocab_size // PANEL), hidden,
                                                     PANEL)
    fused = load_model(pair.path, pack=False)
    assert fused.config.fused_projections and not fused.config.packed_weights
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 256, 19)]
    rows = [Row("a", ids, 0, num_logits=len(ids))]
    (packed_logits,) = PagedSession(loaded).step(rows)
    (fused_logits,) = PagedSession(fused).step(rows)
    assert np.ptp(fused_logits) > 1.0
    np.testing.assert_allclose(packed_logits, fused_logits, atol=1e-5, rtol=0)


def test_packing_needs_fusion(make_pair: Callable[..., Pair]) -> None:
    with pytest.raises(ValueError, match="pack=True needs fuse=True"):
        load_model(make_pair("llama").path, fuse=False, pack=True)
    layer = LayerAttention(AttentionKind.FULL, None, RopeConfig(RopeType.DEFAULT, 10000.0))
    with pytest.raises(ValueError, match="packed_weights=True needs fused_projections=True"):
        DecoderConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_heads=2,
                      num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6,
                      activation=Activation.SILU, layers=(layer,), packed_weights=True)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "xla"])
def test_panels_packed_per_shard_multiply_like_the_whole_weight(
        kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without a mesh (no shard_map) the whole per-shard packing runs, each
    # shard's padding dropped: 2 shards of 48 columns, 16 padding columns each.
    if not kernel:
        monkeypatch.setattr(packed_linear, "kernels_serve", lambda dtype: False)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 96)), jnp.float32)
    panels = pack_per_shard(packed_linear.pack_weight, w, 2)
    assert panels.shape == (4, 64, 32)
    got = packed_linear.packed_matmul(x, panels, 96, jnp.asarray(5), Split.COLUMN, shards=2)
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
    # gate/up per shard: [gate_0 | up_0 | gate_1 | up_1], 24 intermediate columns each.
    gate_up = jnp.asarray(rng.standard_normal((64, 96)), jnp.float32)
    blocks = gate_up.reshape(64, 2, 2, 24)
    gate, up = blocks[:, :, 0].reshape(64, 48), blocks[:, :, 1].reshape(64, 48)
    packed = pack_per_shard(lambda b: packed_linear.pack_gate_up(b, 24), gate_up, 2)
    got = packed_linear.packed_silu_mul(x, packed, 48, jnp.asarray(5), shards=2)
    np.testing.assert_allclose(got, jax.nn.silu(x @ gate) * (x @ up), rtol=1e-5, atol=1e-5)
