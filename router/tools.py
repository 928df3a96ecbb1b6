"""A chat request's tools: the `tools` and `tool_choice` fields checked, and for `required` or
a named function the grammar that makes the sampling nodes write exactly a call (its arguments
valid against the function's JSON schema), in the format the server's tool parser reads.

    tool_choice  none      the model is not asked for calls; its output is content
                 auto      the model may call: what it writes is parsed (router.tool_parsers)
                 required  at least one call (several with parallel_tool_calls), any function
                 {"type": "function", "function": {"name": F}}   exactly one call of F
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from control.structured_output import JSON_OPTIONS
from router.api import ApiError

NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object
    spec: dict[str, Any]  # the request's entry, as the chat template reads it


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function of "named"

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "named")


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def check_tools(tools: list[dict[str, Any]] | None) -> list[Tool]:
    """The request's functions; 400 naming `tools` for anything malformed."""
    out: list[Tool] = []
    if len(tools or []) > MAX_TOOLS:
        raise _invalid("tools", f"at most {MAX_TOOLS} tools")
    for i, entry in enumerate(tools or []):
        where = f"tools[{i}]"
        if entry.get("type") != "function" or not isinstance(entry.get("function"), dict):
            raise _invalid("tools", f'{where} must be {{"type": "function", "function": {{...}}}}')
        function = entry["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise _invalid("tools", f"{where}.function.name must match {NAME.pattern}")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise _invalid("tools", f"{where}.function.parameters must be a JSON schema object")
        if any(tool.name == name for tool in out):
            raise _invalid("tools", f"two tools are named {name!r}")
        out.append(Tool(name, parameters, entry))
    return out


def check_tool_choice(choice: str | dict[str, Any] | None, tools: list[Tool]) -> ToolChoice:
    """The request's tool_choice (default: auto with tools, none without); 400 naming it."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _invalid("tool_choice", "must be none, auto, required or a named function")
        if choice != "none" and not tools:
            raise _invalid("tool_choice", f"{choice} needs tools")
        return ToolChoice(choice)
    function = choice.get("function") if choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise _invalid(
            "tool_choice", 'a named choice is {"type": "function", "function": {"name": ...}}'
        )
    if not any(tool.name == name for tool in tools):
        raise _invalid("tool_choice", f"no tool is named {name!r}")
    return ToolChoice("named", name)


def call_grammar(parser: str, tools: list[Tool], choice: ToolChoice, parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) of the output `choice` forces: one call of the
    named function, or one or more (`parallel`) calls of any; arguments by their schema."""
    chosen = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    repeat = "+" if parallel and choice.mode == "required" else ""
    if parser == "hermes":
        schema = _compact({"anyOf": [_hermes_schema(t) for t in chosen]})
        return (
            f'start: call{repeat}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {json.dumps(schema)}"
        )
    rules = [
        f'call{i}: "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{t.name}\\n```json\\n" '
        f'args{i} "\\n```<｜tool▁call▁end｜>"\nargs{i}: %json {json.dumps(_compact(t.parameters))}'
        for i, t in enumerate(chosen)
    ]
    calls = " | ".join(f"call{i}" for i in range(len(chosen)))
    return (
        f'start: "<｜tool▁calls▁begin｜>" call{repeat} "<｜tool▁calls▁end｜>"\n'
        f"call: {calls}\n" + "\n".join(rules)
    )


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    """JSON without free whitespace, as structured output writes it: free whitespace lets a
    weak model pad forever without closing the object."""
    return {**schema, "x-guidance": JSON_OPTIONS}


def _hermes_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
