"""Tool calls in a model's output, as its chat template has it write them (`[router]
tool_parser`), found while the text streams:

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (any number of them)
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f
                 ```json
                 {...}
                 ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>              (DeepSeek-V3's template)

Text outside the markers is the message's content. A call is handed out once its closing marker
is in (name and arguments together); a call that does not parse (not JSON, no name, arguments
not an object) stays in the content as the text the model wrote, as does an unclosed one at the
end, so nothing the model said is lost. Streamed, text that could still be the start of an
opening marker is held back until the next delta or the end decides it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from control.cluster_config import TOOL_PARSERS
from router.text import partial_marker


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (the OpenAI API's form)


@dataclass(frozen=True)
class _Format:
    open: str  # where the calls (or one call) begin
    close: str  # where they end


FORMATS = {
    "hermes": _Format("<tool_call>", "</tool_call>"),
    "deepseek_v3": _Format("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
}
_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>(?P<name>[^\n]+)\n```(?:json)?\n"
    r"(?P<arguments>.*?)\n?```<｜tool▁call▁end｜>",
    re.DOTALL,
)


class ToolCallSplitter:
    """One choice's output, pushed in order: each push returns the content it can show now and
    the calls completed in it."""

    def __init__(self, parser: str):
        if parser not in FORMATS:
            raise ValueError(f"unknown tool parser {parser!r} (one of {', '.join(TOOL_PARSERS)})")
        self.parser = parser
        self.format = FORMATS[parser]
        self._held = ""  # a possible start of the opening marker, or an open block
        self.num_calls = 0

    def push(self, text: str, is_last: bool = False) -> tuple[str, list[ToolCall]]:
        text = self._held + text
        self._held = ""
        content, calls = [], []
        while text:
            start = text.find(self.format.open)
            if start < 0:
                keep = 0 if is_last else partial_marker(text, self.format.open)
                content.append(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            content.append(text[:start])
            end = text.find(self.format.close, start + len(self.format.open))
            if end < 0:  # the block is still streaming
                if is_last:
                    content.append(text[start:])  # never closed: the model's text as it is
                else:
                    self._held = text[start:]
                break
            block = text[start : end + len(self.format.close)]
            found = self._parse(block[len(self.format.open) : -len(self.format.close)])
            if found is None:
                content.append(block)
            else:
                calls.extend(found)
            text = text[end + len(self.format.close) :]
        self.num_calls += len(calls)
        return "".join(content), calls

    def _parse(self, inner: str) -> list[ToolCall] | None:
        if self.parser == "hermes":
            call = _hermes_call(inner)
            return None if call is None else [call]
        calls, rest = [], inner
        for match in _DEEPSEEK_CALL.finditer(inner):
            arguments = _json_object(match["arguments"])
            if arguments is None:
                return None
            calls.append(ToolCall(match["name"].strip(), arguments))
            rest = rest.replace(match.group(0), "", 1)
        return calls if calls and not rest.strip() else None


def parse_tool_calls(text: str, parser: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output."""
    return ToolCallSplitter(parser).push(text, is_last=True)


def _hermes_call(inner: str) -> ToolCall | None:
    try:
        call = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _json_object(arguments)
        return None if arguments is None else ToolCall(call["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def _json_object(text: str) -> str | None:
    """`text` re-serialized when it is a JSON object, else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None
