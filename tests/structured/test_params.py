"""StructuredOutputsParams and its place in SamplingParams: refusals name the field."""

from __future__ import annotations

import pytest

from esurge import SamplingParams, StructuredOutputsParams
from esurge.errors import InvalidRequestError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(("kwargs", "field"), [
    ({}, "sampling_params.structured_outputs.json"),
    ({"json": SCHEMA, "regex": "a"}, "sampling_params.structured_outputs.regex"),
    ({"choice": ["a"], "grammar": "start: \"a\""}, "sampling_params.structured_outputs.grammar"),
    ({"json": "{not json"}, "sampling_params.structured_outputs.json"),
    ({"json": 3}, "sampling_params.structured_outputs.json"),
    ({"regex": ""}, "sampling_params.structured_outputs.regex"),
    ({"choice": []}, "sampling_params.structured_outputs.choice"),
    ({"choice": "ab"}, "sampling_params.structured_outputs.choice"),
    ({"choice": ["a", ""]}, "sampling_params.structured_outputs.choice"),
    ({"regex": "a", "disable_any_whitespace": True},
     "sampling_params.structured_outputs.disable_any_whitespace"),
    ({"choice": ["a"], "whitespace_pattern": " "},
     "sampling_params.structured_outputs.whitespace_pattern"),
    ({"json_object": True, "whitespace_pattern": " ", "disable_any_whitespace": True},
     "sampling_params.structured_outputs.whitespace_pattern"),
    ({"json_object": 1}, "sampling_params.structured_outputs.json"),
])
def test_refusals_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


def test_one_constraint_of_each_kind() -> None:
    kinds = [StructuredOutputsParams(json=SCHEMA).kind,
             StructuredOutputsParams(json_object=True).kind,
             StructuredOutputsParams(regex="[0-9]{2}").kind,
             StructuredOutputsParams(choice=("a", "b")).kind,
             StructuredOutputsParams(grammar='start: "x"').kind]
    assert kinds == ["json", "json_object", "regex", "choice", "grammar"]


def test_cache_key_is_canonical() -> None:
    text = '{"properties": {"a": {"type": "integer"}}, "type": "object"}'
    assert (StructuredOutputsParams(json=text).cache_key()
            == StructuredOutputsParams(json=SCHEMA).cache_key())
    assert (StructuredOutputsParams(json=SCHEMA).cache_key()
            != StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True).cache_key())
    assert StructuredOutputsParams(choice=["a"]).choice == ("a",)


def test_sampling_params_take_a_dict_and_refuse_ignore_eos() -> None:
    params = SamplingParams(structured_outputs={"regex": "[a-z]{3}"})  # type: ignore[arg-type]
    assert params.structured_outputs == StructuredOutputsParams(regex="[a-z]{3}")
    assert not params.stateless_sampling  # constrained rows never run in a decode burst
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))
    assert err.value.field == "sampling_params.ignore_eos"
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(structured_outputs={"regex": "a", "bogus": 1})  # type: ignore[arg-type]
    assert err.value.field == "sampling_params.structured_outputs"
