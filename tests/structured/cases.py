"""A corpus of constraints for the structured-output tests.

Plain data and two tiny helpers: no JAX, no engine imports, so any test (or a
script) can import it cheaply.

- `JSON_SCHEMAS`: 20 small JSON schemas, each with a hand-written compact
  instance in `EXAMPLES`.
- `REGEXES`: 10 full-match regexes, each with an instance in `REGEX_EXAMPLES`.
- `CHOICES`: 5 choice lists; `choice_lark` turns one into a Lark grammar.
- `validates_json` / `matches_regex`: the checks a constrained output must pass.

Every constraint is bounded so that a random tiny model sampling at
temperature 1.0 ends an instance within about 200 tokens: strings carry a
`maxLength` (or an anchored, bounded `pattern`, or a `format` of bounded
length), arrays a `maxItems` of at most 3, integers a range, and every object
has `additionalProperties: false` (llguidance lets an open object grow extra
keys without end). Regexes use `{m,n}`, never `*` or `+`. No schema recurses.

What llguidance (1.9) does with these schemas, found by compiling them:

- Keys come out in the order of `properties`; optional keys may be skipped.
- Whitespace between tokens is flexible by default (`[ \\t\\n\\r]+`, unbounded);
  compile with `overrides={"whitespace_flexible": False}` to force compact
  `,` / `:` separators, which every instance in `EXAMPLES` uses.
- A `number` with `minimum`/`maximum` is bounded in value but not in digits
  (`0.1234567890123...` is accepted); `multipleOf` bounds the fraction digits,
  so the number schemas here use it.
- String formats llguidance knows: date, time, date-time, duration, email,
  hostname, ipv4, ipv6, uri, uuid (others, e.g. "regex", "idn-email",
  "uri-reference", are compile errors: "Unknown format"). jsonschema's
  FORMAT_CHECKER, without optional packages, checks only date, email,
  idn-email, idn-hostname, ipv4, ipv6, regex and uuid; its "email" check is
  merely "contains @". The schemas here use email, ipv4, ipv6 and uuid, where
  every string llguidance allows also passes jsonschema. "date" is left out on
  purpose: llguidance allows 2023-02-29 and year 0000, which
  `datetime.date.fromisoformat` rejects.
- Unimplemented (compile errors): `uniqueItems`, `not`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import jsonschema

__all__ = [
    "CHOICES",
    "EXAMPLES",
    "JSON_SCHEMAS",
    "REGEXES",
    "REGEX_EXAMPLES",
    "choice_lark",
    "matches_regex",
    "validates_json",
]


def _str(max_length: int, min_length: int = 0) -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def _int(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def _obj(properties: dict[str, Any], required: Iterable[str] | None = None) -> dict[str, Any]:
    """A closed object; every key required unless `required` says otherwise."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties if required is None else required),
        "additionalProperties": False,
    }


JSON_SCHEMAS: dict[str, dict[str, Any]] = {
    # flat object: bounded string and integer
    "person": _obj({"name": _str(12, 1), "age": _int(0, 120)}),
    # objects three deep, a string pattern inside
    "nested_address": _obj(
        {
            "user": _obj(
                {
                    "id": _int(1, 999),
                    "address": _obj(
                        {"city": _str(10, 1), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}
                    ),
                }
            )
        }
    ),
    # array of strings with minItems / maxItems
    "tags": _obj({"tags": {"type": "array", "items": _str(8, 1), "minItems": 1, "maxItems": 3}}),
    # a top-level array of integers
    "int_list": {"type": "array", "items": _int(-50, 50), "minItems": 2, "maxItems": 3},
    # string enums
    "enum_color": _obj(
        {
            "color": {"enum": ["red", "green", "blue"]},
            "shade": {"type": "string", "enum": ["light", "dark"]},
        }
    ),
    # a top-level enum mixing JSON types
    "mixed_enum": {"enum": [1, "two", None, True, 3.5]},
    # numbers with inclusive and exclusive bounds (multipleOf bounds the digits)
    "bounded_numbers": _obj(
        {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
            "celsius": {
                "type": "number",
                "exclusiveMinimum": -10,
                "exclusiveMaximum": 40,
                "multipleOf": 0.5,
            },
        }
    ),
    # integers with exclusive bounds, a negative range, multipleOf
    "bounded_integers": _obj(
        {
            "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "offset": _int(-5, 5),
            "step": {"type": "integer", "minimum": 0, "maximum": 50, "multipleOf": 5},
        }
    ),
    # anchored string patterns
    "patterns": _obj(
        {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
        }
    ),
    # formats of bounded length
    "net_formats": _obj(
        {"ip": {"type": "string", "format": "ipv4"}, "id": {"type": "string", "format": "uuid"}}
    ),
    # email and ipv6 formats, each with a maxLength to keep them short
    "contact_formats": _obj(
        {
            "email": {"type": "string", "format": "email", "maxLength": 12},
            "host_ip": {"type": "string", "format": "ipv6", "maxLength": 12},
        }
    ),
    # minLength / maxLength, one empty string allowed
    "string_lengths": _obj({"code": _str(4, 2), "note": _str(12), "blank": _str(0)}),
    # required and optional keys
    "optional_keys": _obj(
        {"id": _int(0, 9), "nickname": _str(8, 1), "active": {"type": "boolean"}},
        required=["id"],
    ),
    # $ref into $defs, used twice
    "refs": {
        "$defs": {"point": _obj({"x": _int(-9, 9), "y": _int(-9, 9)})},
        **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
    },
    # anyOf of three types
    "any_of": _obj({"value": {"anyOf": [_int(0, 9), _str(5), {"type": "null"}]}}),
    # const values of several types
    "consts": _obj(
        {
            "version": {"const": 1},
            "kind": {"const": "event"},
            "ok": {"type": "boolean"},
        }
    ),
    # booleans only
    "booleans": _obj(
        {"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "boolean"}}
    ),
    # nullable values through type lists and a plain null
    "nullable": _obj(
        {
            "middle_name": {"type": ["string", "null"], "maxLength": 8},
            "score": {"type": ["integer", "null"], "minimum": 0, "maximum": 10},
            "nothing": {"type": "null"},
        }
    ),
    # an array of small objects
    "array_of_objects": {
        "type": "array",
        "items": _obj({"k": {"enum": ["a", "b", "c"]}, "v": _int(0, 9)}),
        "minItems": 1,
        "maxItems": 3,
    },
    # a tuple: prefixItems and no further items
    "tuple": {
        "type": "array",
        "prefixItems": [_str(6, 1), _int(0, 99), {"type": "boolean"}],
        "items": False,
        "minItems": 3,
    },
}

# A valid instance of each schema, compact (no whitespace), keys in schema order.
EXAMPLES: dict[str, str] = {
    "person": '{"name":"Ada","age":36}',
    "nested_address": '{"user":{"id":42,"address":{"city":"Paris","zip":"75001"}}}',
    "tags": '{"tags":["red","small"]}',
    "int_list": "[-3,0,50]",
    "enum_color": '{"color":"green","shade":"dark"}',
    "mixed_enum": '"two"',
    "bounded_numbers": '{"ratio":0.75,"celsius":21.5}',
    "bounded_integers": '{"level":9,"offset":-5,"step":35}',
    "patterns": '{"sku":"ABC-123","hex":"#1a2b3c"}',
    "net_formats": '{"ip":"192.168.0.1","id":"123e4567-e89b-12d3-a456-426614174000"}',
    "contact_formats": '{"email":"bob@mail.io","host_ip":"fe80::1"}',
    "string_lengths": '{"code":"AB1","note":"hello world","blank":""}',
    "optional_keys": '{"id":7,"active":true}',
    "refs": '{"start":{"x":-1,"y":2},"end":{"x":3,"y":-4}}',
    "any_of": '{"value":"hi"}',
    "consts": '{"version":1,"kind":"event","ok":false}',
    "booleans": '{"a":true,"b":false,"c":true}',
    "nullable": '{"middle_name":null,"score":7,"nothing":null}',
    "array_of_objects": '[{"k":"a","v":1},{"k":"c","v":9}]',
    "tuple": '["abc",12,true]',
}

# Full-match regexes (as llguidance's grammar_from_regex reads them), bounded length.
# ASCII classes ([0-9], not \d: both llguidance and Python's re let \d match
# any Unicode digit).
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
REGEXES: dict[str, str] = {
    "iso_date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "us_phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "hex_color": r"#[0-9a-fA-F]{6}",
    "simple_email": r"[a-z][a-z0-9._]{0,7}@[a-z]{2,8}\.(com|org|net)",
    "ipv4": rf"({_OCTET}\.){{3}}{_OCTET}",
    "identifier": r"[A-Za-z_][A-Za-z0-9_]{0,11}",
    "semver": r"(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})",
    "animal": r"(cat|dog|bird|fish)s?",
    "pin6": r"[0-9]{6}",
    "time_24h": r"([01][0-9]|2[0-3]):[0-5][0-9]",
}

REGEX_EXAMPLES: dict[str, str] = {
    "iso_date": "2024-02-29",
    "us_phone": "(555) 123-4567",
    "hex_color": "#FFa500",
    "simple_email": "j.doe@example.com",
    "ipv4": "10.0.255.1",
    "identifier": "_tmp_var9",
    "semver": "1.20.3",
    "animal": "dogs",
    "pin6": "007123",
    "time_24h": "23:59",
}

CHOICES: dict[str, tuple[str, ...]] = {
    "yes_no": ("yes", "no"),
    "colors": ("red", "reddish", "redder", "green", "blue"),  # shared prefixes
    "sentiment": ("positive", "negative", "neutral"),
    "prefix_words": ("on", "one", "once", "only"),  # one choice is a prefix of the rest
    "phrases": ("I don't know.", "Yes, definitely!", 'Say "hi" - then stop...', "no"),
}


def choice_lark(options: Iterable[str]) -> str:
    """A Lark grammar matching exactly one of `options` (JSON-escaped literals)."""
    return "start: " + " | ".join(json.dumps(option) for option in options)


def validates_json(schema: dict[str, Any], text: str) -> bool:
    """Whether `text` is JSON that satisfies `schema`, formats included."""
    try:
        validator = jsonschema.Draft202012Validator(
            schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        )
        validator.validate(json.loads(text))
    except Exception:
        return False
    return True


def matches_regex(pattern: str, text: str) -> bool:
    """Whether all of `text` matches `pattern`."""
    return re.fullmatch(pattern, text) is not None
