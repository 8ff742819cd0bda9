"""Step buckets: the padded shapes every step lands in."""

from __future__ import annotations

import pytest

from esurge.runner.buckets import StepBuckets


def test_token_buckets_are_powers_of_two_then_one_and_a_half_then_quarter_steps() -> None:
    buckets = StepBuckets.create(2048, 32, (8, 16, 32))
    assert buckets.token_buckets == (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792,
                                     2048)
    assert buckets.request_buckets == (8, 16, 32)


def test_budget_that_is_not_a_power_of_two_is_the_last_bucket() -> None:
    assert StepBuckets.create(1000, 4).token_buckets == (16, 32, 64, 128, 256, 512, 768, 1000)
    assert StepBuckets.create(1400, 4).token_buckets == (16, 32, 64, 128, 256, 512, 768, 1024,
                                                         1280, 1400)
    assert StepBuckets.create(600, 4).token_buckets == (16, 32, 64, 128, 256, 512, 600)
    assert StepBuckets.create(100, 4).token_buckets == (16, 32, 64, 100)


@pytest.mark.parametrize(("tokens", "bucket"), [(1, 16), (16, 16), (17, 32), (513, 768),
                                                (1031, 1280), (1537, 1792), (1793, 2048),
                                                (2048, 2048)])
def test_a_step_pads_to_the_smallest_bucket_that_holds_it(tokens: int, bucket: int) -> None:
    assert StepBuckets.create(2048, 32).tokens_for(tokens) == bucket


def test_too_many_tokens_or_requests_is_refused() -> None:
    buckets = StepBuckets.create(256, 8)
    with pytest.raises(ValueError, match="num_tokens=257 exceeds the largest bucket 256"):
        buckets.tokens_for(257)
    with pytest.raises(ValueError, match="num_requests=9 exceeds the largest bucket 8"):
        buckets.requests_for(9)


def test_shapes_pair_request_buckets_only_with_token_buckets_that_can_hold_them() -> None:
    buckets = StepBuckets.create(64, 32, (8, 16, 32))
    # 16 tokens can carry at most 16 requests, so (16, 32) never happens.
    assert (16, 32) not in buckets.shapes()
    assert {(16, 8), (16, 16), (32, 32), (64, 32)} <= set(buckets.shapes())


def _model_shapes(buckets: StepBuckets) -> list[tuple[int, int]]:
    return list(dict.fromkeys((t, buckets.model_requests(r)) for t, r in buckets.shapes()))


def test_plain_model_steps_pad_requests_to_the_largest_bucket_the_smallest_step_holds() -> None:
    # make serve's buckets: a 16-token step holds 16 requests, so the model
    # compiles one request dimension per token bucket (5 shapes, not 10).
    serve = StepBuckets.create(256, 16, (4, 16))
    assert serve.request_floor == 16
    assert [serve.model_requests(r) for r in (4, 16)] == [16, 16]
    assert _model_shapes(serve) == [(16, 16), (32, 16), (64, 16), (128, 16), (256, 16)]
    # Buckets past the floor keep their own model steps.
    wide = StepBuckets.create(64, 64, (8, 16, 32, 64))
    assert wide.request_floor == 16
    assert _model_shapes(wide) == [(16, 16), (32, 16), (32, 32), (64, 16), (64, 32), (64, 64)]
    # No bucket fits the smallest step: the smallest bucket is the floor.
    assert StepBuckets.create(64, 64, (32, 64)).request_floor == 32
