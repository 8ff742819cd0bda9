"""What shape a request's output must take: vLLM's `StructuredOutputsParams`.

Exactly one constraint is given: a JSON schema, any JSON object, a regular
expression, a list of choices or a Lark grammar. The knobs beside it are the
ones the backend (llguidance) honours; each is refused when it cannot apply
to the chosen constraint rather than being ignored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from esurge.errors import InvalidRequestError, RequestField

__all__ = ["CONSTRAINT_KINDS", "StructuredOutputsParams"]

# The constraint fields, in the order the proto's oneof lists them.
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _field(name: str) -> str:
    return RequestField.sampling(f"structured_outputs.{name}")


def _fail(name: str, message: str) -> None:
    raise InvalidRequestError(_field(name), message)


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One output constraint and the options that shape it.

    json is a JSON schema (a dict, or its JSON text); json_object True asks
    for any JSON object; regex must match the whole output; choice is a list
    of strings the output is exactly one of; grammar is a Lark grammar (rule
    `start`; llguidance's dialect, which also takes `%json` and regex
    terminals). disable_any_whitespace makes JSON compact (no whitespace
    outside strings); whitespace_pattern replaces the JSON whitespace regex;
    disable_additional_properties treats every object of the schema that
    does not say otherwise as `additionalProperties: false`.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, tuple | list):
                _fail("choice", f"choice must be a list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in CONSTRAINT_KINDS if self._is_set(k)]
        if len(given) != 1:
            name = given[1] if len(given) > 1 else "json"
            _fail(name, "structured_outputs needs exactly one of json, json_object, regex, "
                        f"choice or grammar, got {given or 'none'}")
        self._check_constraint(given[0])
        self._check_knobs(given[0])

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is True if kind == "json_object" else value is not None

    def _check_constraint(self, kind: str) -> None:
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    _fail("json", f"json must be a JSON schema: {exc}")
            if not isinstance(schema, dict | bool):
                _fail("json", f"json must be a JSON schema object, got {type(schema).__name__}")
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                _fail(kind, f"{kind} must be a non-empty string, got {value!r}")
        elif kind == "choice":
            choices = self.choice or ()
            if not choices or not all(isinstance(c, str) and c for c in choices):
                _fail("choice", f"choice must be a non-empty list of non-empty strings, "
                                f"got {list(choices)!r}")

    def _check_knobs(self, kind: str) -> None:
        if not isinstance(self.json_object, bool):
            _fail("json_object", f"json_object must be a bool, got {self.json_object!r}")
        json_kind = kind in ("json", "json_object")
        for knob in ("disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, knob)
            if not isinstance(value, bool):
                _fail(knob, f"{knob} must be a bool, got {value!r}")
            if value and not json_kind:
                _fail(knob, f"{knob} applies to json and json_object constraints, not {kind}")
        pattern = self.whitespace_pattern
        if pattern is not None:
            if not isinstance(pattern, str) or not pattern:
                _fail("whitespace_pattern", f"whitespace_pattern must be a non-empty regex, "
                                            f"got {pattern!r}")
            if not json_kind:
                _fail("whitespace_pattern", "whitespace_pattern applies to json and json_object "
                                            f"constraints, not {kind}")
            if self.disable_any_whitespace:
                _fail("whitespace_pattern", "whitespace_pattern and disable_any_whitespace "
                                            "cannot both be given")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of CONSTRAINT_KINDS."""
        return next(k for k in CONSTRAINT_KINDS if self._is_set(k))

    @property
    def field(self) -> str:
        """The field path of the constraint, for errors about it."""
        return _field(self.kind)

    def schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema as a Python value (json_object: any object)."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.json is None:
            return None
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    def cache_key(self) -> str:
        """A stable digest of everything that shapes the compiled grammar."""
        canonical = json.dumps({
            "kind": self.kind, "json": self.schema(), "regex": self.regex,
            "choice": list(self.choice) if self.choice is not None else None,
            "grammar": self.grammar, "compact": self.disable_any_whitespace,
            "closed": self.disable_additional_properties, "ws": self.whitespace_pattern,
        }, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()
