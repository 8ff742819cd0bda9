"""EngineSettings: validation naming the field, one override path."""

from __future__ import annotations

import pytest

from esurge.errors import InvalidConfigError
from esurge.settings import EngineSettings


@pytest.mark.parametrize(
    ("field", "bad"),
    [("dtype", "float16"), ("dtype", "auto "), ("memory_fraction", 0.0),
     ("memory_fraction", 1.01), ("memory_fraction", True), ("memory_fraction", "0.5"),
     ("min_token_bucket", 0), ("min_token_bucket", 2.0), ("decode_steps", 0),
     ("decode_steps", True), ("decode_steps", "4"), ("kv_cache_dtype", "float16"),
     ("kv_cache_dtype", None), ("speculation", "never")],
)
def test_a_bad_value_is_refused_naming_its_field(field: str, bad: object) -> None:
    with pytest.raises(InvalidConfigError) as info:
        EngineSettings(**{field: bad})  # type: ignore[arg-type]
    assert info.value.field == field
    assert repr(bad) in str(info.value)


def test_overrides_apply_what_is_given_and_validate_it() -> None:
    base = EngineSettings(dtype="float32", decode_steps=4)
    assert base.with_overrides() is base
    assert base.with_overrides(dtype=None, decode_steps=None) is base
    assert base.with_overrides(memory_fraction=0.5, decode_steps=2) == EngineSettings(
        dtype="float32", memory_fraction=0.5, decode_steps=2)
    with pytest.raises(InvalidConfigError) as info:
        base.with_overrides(min_token_bucket=-3)
    assert info.value.field == "min_token_bucket"
    with pytest.raises(TypeError, match="max_num_seqs"):
        base.with_overrides(max_num_seqs=4)


def test_decode_bursts_and_speculation_do_not_mix() -> None:
    EngineSettings(decode_steps=4).check_speculation(0)
    EngineSettings().check_speculation(3)
    with pytest.raises(InvalidConfigError) as info:
        EngineSettings(decode_steps=4).check_speculation(3)
    assert info.value.field == "decode_steps"
