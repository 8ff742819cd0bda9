"""bfloat16 checkpoints served in float32 keep their own values (WIDENED_BITS).

Where the CPU has no bfloat16 dot products, a bfloat16 checkpoint serves in
float32; its projections keep the checkpoint's two-byte values in panels that
cpu_kernels/widened_matmul.cc widens in registers. Widening is exact, so the
promise is bit-identity: the kernel returns what the float32 panel kernel
returns on the upcast weight, and a whole model returns the logits of a
float32 checkpoint holding the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from esurge.models.cpu_kernels import kernel_available, packed_matmul_kernel, widened_matmul_kernel
from esurge.models.decoder_config import WIDENED_BITS
from esurge.models.loader import load_model
from esurge.models.packed_linear import pack_gate_up, pack_weight
from tests.models.checkpoints import build_model, hf_config, save_checkpoint
from tests.models.conftest import FAMILIES
from tests.models.paged import PagedSession, Row, greedy_generate

needs_kernels = pytest.mark.skipif(not kernel_available(), reason="no C++ compiler here")

ALL_ROLES = ("down_proj", "gate_up_proj", "lm_head", "o_proj", "qkv_proj")


def _bits(a: jnp.ndarray) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 17])
def test_widened_kernel_is_bit_identical_to_the_float32_panel_kernel(rows: int) -> None:
    rng = np.random.default_rng(rows)
    out, inputs = 72, 96  # a partial last panel
    weight = jnp.asarray(rng.standard_normal((inputs, out)), jnp.bfloat16).astype(jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows + 2, inputs)).astype(np.float32))
    real = jnp.int32(rows)  # the last two rows are bucket padding
    got = widened_matmul_kernel(x, pack_weight(weight).astype(jnp.bfloat16), out, real)
    want = packed_matmul_kernel(x, pack_weight(weight), out, real)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert not np.asarray(got)[rows:].any()
    gated = pack_gate_up(weight, out // 2)
    got = widened_matmul_kernel(x, gated.astype(jnp.bfloat16), out // 2, real, silu_mul=True)
    want = packed_matmul_kernel(x, gated, out // 2, real, silu_mul=True)
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.fixture(scope="module")
def same_values(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """(bfloat16 checkpoint, float32 checkpoint of the same values) per family."""
    made: dict[str, tuple[Path, Path]] = {}

    def make(family: str) -> tuple[Path, Path]:
        if family not in made:
            model = build_model(hf_config(family), seed=3).to(torch.bfloat16)
            bf16 = save_checkpoint(model, tmp_path_factory.mktemp(f"bf16-{family}"))
            f32 = save_checkpoint(model.to(torch.float32),
                                  tmp_path_factory.mktemp(f"f32-{family}"))
            made[family] = (bf16, f32)
        return made[family]

    return make


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_a_bfloat16_checkpoint_in_float32_computes_exactly_its_upcast_copy(
        family: str, same_values: Callable[[str], tuple[Path, Path]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESURGE_BF16_KERNELS", "0")  # as on a CPU without AVX512_BF16
    bf16_path, f32_path = same_values(family)
    ours, reference = load_model(bf16_path), load_model(f32_path)
    assert ours.dtype == reference.dtype == "float32"
    # Gemma's GELU MLP has no fused SiLU gate: its gate/up stays in float32 panels.
    roles = tuple(r for r in ALL_ROLES if r != "gate_up_proj" or not family.startswith("gemma"))
    assert ours.config.coded_weights == tuple((r, WIDENED_BITS) for r in roles)
    assert reference.config.coded_weights == ()
    attn = ours.params["model"]["layers"][0]["self_attn"]
    assert attn["qkv_proj"]["weight"]["panels"].dtype == jnp.bfloat16
    assert ours.params["lm_head"]["weight"]["panels"].dtype == jnp.bfloat16

    ids = [int(t) for t in np.random.default_rng(4).integers(3, 250, 17)]
    rows = [Row("a", ids, 0, len(ids)), Row("b", ids[:5], 0, 2)]  # 22 rows: the expanded panel
    for got, want in zip(PagedSession(ours).step(rows), PagedSession(reference).step(rows),
                         strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(want))
    prompts = [ids[:9], ids[4:17], ids[2:6]]  # decode steps of one to three rows
    assert (greedy_generate(PagedSession(ours), prompts, 6)
            == greedy_generate(PagedSession(reference), prompts, 6))


@needs_kernels
def test_widened_panels_come_back_from_the_layout_cache_and_halve_the_bytes(
        same_values: Callable[[str], tuple[Path, Path]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESURGE_BF16_KERNELS", "0")
    bf16_path, f32_path = same_values("llama")
    first, again = load_model(bf16_path), load_model(bf16_path)  # the second from the cache
    assert again.config == first.config
    mlp = "model", "layers", 0, "mlp", "down_proj", "weight"
    widened, cached = first.params, again.params
    for key in mlp:
        widened, cached = widened[key], cached[key]
    np.testing.assert_array_equal(np.asarray(widened["panels"]), np.asarray(cached["panels"]))
    plain = load_model(f32_path).params["model"]["layers"][0]["mlp"]["down_proj"]["weight"]
    assert widened["panels"].nbytes * 2 == plain.nbytes


def test_a_float32_checkpoint_and_a_bfloat16_model_keep_no_widened_panels(
        same_values: Callable[[str], tuple[Path, Path]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    bf16_path, f32_path = same_values("llama")
    assert load_model(f32_path).config.coded_weights == ()
    unpacked = load_model(bf16_path, "bfloat16", pack=False)
    assert unpacked.config.coded_weights == ()
    monkeypatch.setenv("ESURGE_BF16_KERNELS", "0")
    monkeypatch.setenv("ESURGE_WIDENED_PANELS", "0")  # the operator's way back to upcasting
    upcast = load_model(bf16_path)
    assert upcast.dtype == "float32" and upcast.config.packed_weights
    assert upcast.config.coded_weights == ()
