"""The request fields that ask for structured output, read into SamplingParams' (kind, spec).

OpenAI's `response_format` (`{"type": "text"}`, `{"type": "json_object"}`, `{"type":
"json_schema", "json_schema": {"name", "schema", "strict", "description"}}`) on both endpoints,
and vLLM's `guided_json` (a schema object, or its JSON text), `guided_regex`, `guided_choice`
(strings), `guided_grammar` (Lark, llguidance's dialect) and the newer `structured_outputs`
object (`json`, `regex`, `choice`, `grammar`, `json_object`). At most one per request. The spec
is compiled here against the model's tokenizer (`Requested.check`), so a bad
schema or regex is a 400 with the library's reason before anything is dispatched. A schema is
enforced as written; `strict` adds nothing to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from control.errors import InvalidRequestError
from control.structured_output import GrammarChecker, StructuredOutput

FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
# structured_outputs' keys -> the kind each asks for
STRUCTURED_OUTPUTS_KINDS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


class StructuredFieldError(ValueError):
    """A structured-output field is malformed or its spec does not compile (a 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class Requested:
    """The structured output a body asks for: the field that asked, and SamplingParams'
    (kind, spec)."""

    param: str
    structured: tuple[str, ...]

    def check(self, grammars: GrammarChecker) -> None:
        """StructuredFieldError (naming the field) when the spec does not compile."""
        try:
            grammars.check(self.structured)
        except InvalidRequestError as exc:
            raise StructuredFieldError(self.param, str(exc)) from None


def requested(body: Any, after: str = "") -> Requested | None:
    """What the body asks for (starting after the text `after` when it is not empty), or None
    for free text; StructuredFieldError when a field is malformed, too large, or more than one
    is set. Compiling is `Requested.check`'s."""
    found = []
    for name in FIELDS:
        value = getattr(body, name, None)
        spec = None if value is None else _READERS[name](value)
        if spec is not None:
            found.append(Requested(name, (*spec, after) if after else spec))
    if len(found) > 1:
        names = ", ".join(r.param for r in found)
        raise StructuredFieldError(
            found[1].param, f"at most one structured output field per request, got {names}"
        )
    if not found:
        return None
    try:
        StructuredOutput.of(found[0].structured)  # kind and size, before any compiling
    except InvalidRequestError as exc:
        raise StructuredFieldError(found[0].param, str(exc)) from None
    return found[0]


def _schema_text(param: str, schema: Any) -> str:
    """A schema object (or its JSON text) as canonical JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise StructuredFieldError(param, f"not valid JSON ({exc})") from None
    if not isinstance(schema, (dict, bool)):
        raise StructuredFieldError(param, "must be a JSON schema (an object)")
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _response_format(value: dict[str, Any]) -> tuple[str, str] | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", ""
    if kind != "json_schema":
        raise StructuredFieldError(
            "response_format",
            f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise StructuredFieldError(
            "response_format", "json_schema must be an object with a name and a schema"
        )
    if "schema" not in spec:
        raise StructuredFieldError("response_format", "json_schema.schema is required")
    return "json_schema", _schema_text("response_format", spec["schema"])


def _guided_json(value: dict[str, Any] | str) -> tuple[str, str]:
    return "json_schema", _schema_text("guided_json", value)


def _choice(param: str, value: Any) -> tuple[str, str]:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise StructuredFieldError(param, "must be a list of strings")
    return "choice", json.dumps(value, ensure_ascii=False)


def _text(param: str, kind: str, value: Any) -> tuple[str, str]:
    if not isinstance(value, str):
        raise StructuredFieldError(param, f"the {kind} must be a string")
    return kind, value


def _structured_outputs(value: dict[str, Any]) -> tuple[str, str] | None:
    param = "structured_outputs"
    unknown = sorted(k for k in value if k not in STRUCTURED_OUTPUTS_KINDS)
    if unknown:
        raise StructuredFieldError(param, f"unsupported keys {unknown}")
    set_keys = [k for k, v in value.items() if v is not None and v is not False]
    if len(set_keys) > 1:
        raise StructuredFieldError(param, f"set one of its keys, got {set_keys}")
    if not set_keys:
        return None
    key = set_keys[0]
    item = value[key]
    if key == "json":
        return "json_schema", _schema_text(f"{param}.json", item)
    if key == "choice":
        return _choice(f"{param}.choice", item)
    if key == "json_object":
        if item is not True:
            raise StructuredFieldError(f"{param}.json_object", "must be true")
        return "json_object", ""
    return _text(f"{param}.{key}", STRUCTURED_OUTPUTS_KINDS[key], item)


_READERS = {
    "response_format": _response_format,
    "guided_json": _guided_json,
    "guided_regex": lambda v: _text("guided_regex", "regex", v),
    "guided_choice": lambda v: _choice("guided_choice", v),
    "guided_grammar": lambda v: _text("guided_grammar", "grammar", v),
    "structured_outputs": _structured_outputs,
}
