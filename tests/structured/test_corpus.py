"""Every output that ends STOP satisfies its constraint: 20 schemas, 10 regexes,
5 choice lists, 50 seeded samples each at temperature 1.0 on a random model."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from esurge import SamplingParams, StructuredOutputsParams
from tests.structured.cases import (
    CHOICES,
    JSON_SCHEMAS,
    REGEXES,
    matches_regex,
    validates_json,
)

SAMPLES = 50
MAX_TOKENS = 200


def _run(engine: Any, so: StructuredOutputsParams) -> list[tuple[str, str]]:
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
                             structured_outputs=so) for seed in range(SAMPLES)]
    outs = engine.generate(["{"] * SAMPLES, params)
    return [(o.outputs[0].text, str(o.outputs[0].finish_reason)) for o in outs]


def _check(results: list[tuple[str, str]], ok: Any, what: str) -> Counter[str]:
    reasons: Counter[str] = Counter()
    for text, reason in results:
        reasons[reason] += 1
        if reason == "stop":
            assert ok(text), f"{what}: a STOP output breaks the constraint: {text!r}"
    return reasons


@pytest.mark.parametrize("name", sorted(JSON_SCHEMAS))
def test_json_schema_outputs_validate(random_engine: Any, name: str) -> None:
    schema = JSON_SCHEMAS[name]
    so = StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True)
    reasons = _check(_run(random_engine, so), lambda t: validates_json(schema, t), name)
    assert reasons["stop"] >= SAMPLES // 2, reasons  # the check ran on most samples


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_regex_outputs_match(random_engine: Any, name: str) -> None:
    pattern = REGEXES[name]
    so = StructuredOutputsParams(regex=pattern)
    reasons = _check(_run(random_engine, so), lambda t: matches_regex(pattern, t), name)
    assert reasons["stop"] == SAMPLES, reasons  # bounded regexes always end


@pytest.mark.parametrize("name", sorted(CHOICES))
def test_choice_outputs_are_members(random_engine: Any, name: str) -> None:
    options = CHOICES[name]
    results = _run(random_engine, StructuredOutputsParams(choice=options))
    reasons = _check(results, lambda t: t in options, name)
    assert reasons["stop"] == SAMPLES, reasons
    # Sampling at temperature 1.0 reaches more than one option.
    assert len({t for t, _ in results}) > 1


def test_each_sample_of_n_follows_the_constraint(random_engine: Any) -> None:
    options = CHOICES[sorted(CHOICES)[0]]
    params = SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(choice=options))
    [out] = random_engine.generate(["{"], params)
    assert len(out.outputs) == 6
    assert all(c.text in options and c.finish_reason == "stop" for c in out.outputs)


def test_a_cut_off_output_ends_length_and_a_stop_string_still_stops(random_engine: Any) -> None:
    schema = JSON_SCHEMAS["person"]
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    [cut] = random_engine.generate(["{"], SamplingParams(temperature=1.0, seed=1, max_tokens=3,
                                                          structured_outputs=so))
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 3
    assert cut.outputs[0].text.startswith("{")
    [stopped] = random_engine.generate(["{"], SamplingParams(
        temperature=1.0, seed=1, max_tokens=MAX_TOKENS, stop=[":"], structured_outputs=so))
    completion = stopped.outputs[0]
    assert completion.finish_reason == "stop" and ":" not in completion.text
    assert completion.text.startswith('{"')  # the constraint held up to the stop string
