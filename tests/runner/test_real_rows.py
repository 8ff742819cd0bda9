"""Per-row work over a step's real rows: the rows `sample` would give, zeros past them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from esurge.models.reductions import first_argmax
from esurge.runner.real_rows import argmax_rows, one_row_at_a_time, sample_rows
from esurge.runner.sampler import sample_jit
from esurge.runner.sampling_batch import SamplingBatch
from esurge.sampling_params import SamplingParams

V, ROWS = 64, 6


def test_a_cpu_step_without_a_mesh_goes_one_row_at_a_time() -> None:
    assert one_row_at_a_time() == (jax.default_backend() == "cpu")


def test_real_rows_are_sampled_as_sample_does_and_padding_rows_are_zero() -> None:
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(ROWS, V)).astype(np.float32) * 3)
    batch = SamplingBatch(ROWS, V)
    params = [SamplingParams(temperature=0.9, top_k=8, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_p=0.8, seed=7),
              SamplingParams(temperature=0.7, min_p=0.05, seed=3)]
    for i, p in enumerate(params):
        batch.set_row(i, p, [1, 2], [], None)
    order = np.arange(len(params))
    variant = batch.variant(order)
    tensors = batch.tensors(order, ROWS, np.arange(len(params), dtype=np.int32), variant)
    want = np.asarray(sample_jit(logits, tensors, variant).token_ids)
    got = np.asarray(jax.jit(sample_rows, static_argnames="variant")(
        logits, tensors, jnp.int32(len(params)), variant=variant).token_ids)
    np.testing.assert_array_equal(got[:len(params)], want[:len(params)])
    assert want[len(params):].any() and not got[len(params):].any()


def test_greedy_rows_are_the_first_argmax_of_real_rows_only() -> None:
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(ROWS, V)).astype(np.float32))
    got = np.asarray(jax.jit(argmax_rows)(logits, jnp.int32(3)))
    want = np.asarray(first_argmax(logits))
    np.testing.assert_array_equal(got[:3], want[:3])
    assert want[3:].any() and not got[3:].any()
