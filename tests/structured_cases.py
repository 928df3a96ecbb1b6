"""Structured-output cases shared by the engine, node and e2e suites, and their oracle: the
output parses (json.loads) and validates (jsonschema), fully matches the regex, or is one of
the choices. The schemas are bounded (enum, maxLength, maxItems, integer ranges) so that the
tiny random-weight model completes them well within MAX_NEW tokens."""

from __future__ import annotations

import json
import re

import jsonschema

MAX_NEW = 96

OBJECT_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}
STRING_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8}},
    "required": ["name"],
    "additionalProperties": False,
}
ARRAY_SCHEMA = {
    "type": "object",
    "properties": {
        "xs": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 1,
            "maxItems": 3,
        },
        "tag": {"enum": ["a", "b"]},
    },
    "required": ["xs", "tag"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe so"]

# name -> (kind, spec) as SamplingParams.structured carries it
CASES: dict[str, tuple[str, str]] = {
    "object": ("json_schema", json.dumps(OBJECT_SCHEMA)),
    "string": ("json_schema", json.dumps(STRING_SCHEMA)),
    "array": ("json_schema", json.dumps(ARRAY_SCHEMA)),
    "regex": ("regex", REGEX),
    "choice": ("choice", json.dumps(CHOICES)),
}
# Any JSON object: unbounded, so a random model may well never close it; tests use it only
# where a prompt is known to complete (or compare with the offline run, complete or not).
JSON_OBJECT = ("json_object", "")


def check_output(kind: str, spec: str, text: str) -> None:
    """AssertionError (or jsonschema's ValidationError) unless `text` satisfies the spec."""
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(spec))
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(spec, text), text
    elif kind == "choice":
        assert text in json.loads(spec), text
    else:
        raise ValueError(kind)
