"""Tool calls in a model's output, as its chat template has it write them (`[router]
tool_parser`), found while the text streams:

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (any number of them)
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f
                 ```json
                 {...}
                 ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>              (DeepSeek-V3's template)

Text outside the markers is the message's content. The arguments are handed out as the model
wrote them (the JSON object's own text, not re-serialized), so the pieces of a streamed call
join to exactly what the whole output gives.

Whole (`stream_arguments` off, the non-streamed response): a call is handed out once its block
closes and parses; a block that does not (not JSON, no name, arguments not an object) stays in
the content as the text the model wrote, as does an unclosed one at the end, so nothing the
model said is lost.

Streamed (`stream_arguments` on), as OpenAI streams calls: a call is announced (its index and
name) as soon as its header is complete, then its arguments come in pieces as they are written;
what is left over when the block closes (calls the header pattern did not catch) comes whole
then. A call once announced cannot be taken back: when its block turns out malformed, or never
closes, the calls already streamed stay as they went out and the rest of the block's text is
content. Text that could still be the start of an opening marker is held back until the next
delta or the end decides it.
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
class ToolCallDelta:
    """A piece of the choice's `index`-th call: `name` on its first piece only."""

    index: int
    name: str | None
    arguments: str


@dataclass(frozen=True)
class _Format:
    open: str  # where the calls (or one call) begin
    close: str  # where they end
    header: re.Pattern  # a call's start, up to the `{` of its arguments (group "name")
    between: re.Pattern | None  # after one call's arguments, before the next header (None: one)


_NAME = r'"(?P<name>(?:[^"\\\n]|\\.)*)"'
FORMATS = {
    "hermes": _Format(
        "<tool_call>",
        "</tool_call>",
        re.compile(
            r'\s*\{\s*"name"\s*:\s*' + _NAME + r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
        ),
        None,
    ),
    "deepseek_v3": _Format(
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        re.compile(
            r"\s*<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>(?P<name>[^\n]+)\n```(?:json)?\n\s*(?=\{)"
        ),
        re.compile(r"\s*```<｜tool▁call▁end｜>"),
    ),
}
_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>(?P<name>[^\n]+)\n```(?:json)?\n"
    r"(?P<arguments>.*?)\n?```<｜tool▁call▁end｜>",
    re.DOTALL,
)


class _ObjectEnd:
    """Finds where a JSON object ends in text that arrives in pieces: nesting depth and string
    state carried across pieces."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str, start: int) -> tuple[int, bool]:
        """(the position scanned up to, whether the object closed there)."""
        for i in range(start, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
        return len(text), False


class ToolCallSplitter:
    """One choice's output, pushed in order: each push returns the content it can show now and
    the call pieces found in it."""

    def __init__(self, parser: str, stream_arguments: bool = False):
        if parser not in FORMATS:
            raise ValueError(f"unknown tool parser {parser!r} (one of {', '.join(TOOL_PARSERS)})")
        self.parser = parser
        self.format = FORMATS[parser]
        self.stream_arguments = stream_arguments
        self._held = ""  # a possible start of the opening marker, or an open block
        self.num_calls = 0
        self._new_block()

    def _new_block(self) -> None:
        # The open block's streaming state: where its text is read up to, what is expected
        # there ("header", "arguments", "between"), and the calls already announced from it.
        self._pos = 0
        self._expect = "header"
        self._object = _ObjectEnd()
        self._sent: list[ToolCall] = []

    def push(self, text: str, is_last: bool = False) -> tuple[str, list[ToolCallDelta]]:
        text = self._held + text
        self._held = ""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        opener, closer = self.format.open, self.format.close
        while text:
            start = text.find(opener)
            if start < 0:
                keep = 0 if is_last else partial_marker(text, opener)
                content.append(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            content.append(text[:start])
            inner_start = start + len(opener)
            end = text.find(closer, inner_start)
            if end < 0:  # the block is still streaming
                if self.stream_arguments:
                    deltas += self._stream(text[inner_start:])
                if is_last:  # never closed: what was not streamed is the model's text as it is
                    content.append(
                        text[start:] if not self._sent else text[inner_start + self._pos :]
                    )
                    self._new_block()
                else:
                    self._held = text[start:]
                break
            block = text[start : end + len(closer)]
            found, leftover = self._close(text[inner_start:end], deltas)
            if found is None:
                content.append(block)
            content.append(leftover)
            text = text[end + len(closer) :]
        return "".join(content), deltas

    def _stream(self, inner: str) -> list[ToolCallDelta]:
        """The pieces of the open block's calls that `inner` (its text so far) completes."""
        out: list[ToolCallDelta] = []
        while True:
            if self._expect == "header":
                match = self.format.header.match(inner, self._pos)
                name = None if match is None else _name(self.parser, match["name"])
                if name is None:
                    return out
                self._sent.append(ToolCall(name, ""))
                out.append(self._delta(name, ""))
                self._pos, self._expect, self._object = match.end(), "arguments", _ObjectEnd()
            if self._expect == "arguments":
                end, closed = self._object.scan(inner, self._pos)
                piece = inner[self._pos : end]
                if piece:
                    call = self._sent[-1]
                    self._sent[-1] = ToolCall(call.name, call.arguments + piece)
                    out.append(ToolCallDelta(self.num_calls - 1, None, piece))
                self._pos = end
                if not closed:
                    return out
                self._expect = "between"
            if self.format.between is None:
                return out
            match = self.format.between.match(inner, self._pos)
            if match is None:
                return out
            self._pos, self._expect = match.end(), "header"

    def _close(self, inner: str, deltas: list[ToolCallDelta]) -> tuple[list[ToolCall] | None, str]:
        """A closed block: (its calls or None when it does not parse, content left over);
        appends to `deltas` what of its calls was not streamed yet."""
        if self.stream_arguments:
            deltas += self._stream(inner)
        sent, pos = self._sent, self._pos
        self._new_block()
        found = self._parse(inner)
        if not sent:
            for call in found or ():
                deltas.append(self._delta(call.name, call.arguments))
            return found, ""
        if found is None or not _continues(sent, found):
            return [], inner[pos:]  # the announced calls stand; the rest is the model's text
        for i, call in enumerate(found):
            if i < len(sent):
                rest = call.arguments[len(sent[i].arguments) :]
                if rest:
                    deltas.append(ToolCallDelta(self.num_calls - len(sent) + i, None, rest))
            else:
                deltas.append(self._delta(call.name, call.arguments))
        return found, ""

    def _delta(self, name: str, arguments: str) -> ToolCallDelta:
        self.num_calls += 1
        return ToolCallDelta(self.num_calls - 1, name, arguments)

    def _parse(self, inner: str) -> list[ToolCall] | None:
        if self.parser == "hermes":
            call = _hermes_call(inner)
            return None if call is None else [call]
        calls, rest = [], inner
        for match in _DEEPSEEK_CALL.finditer(inner):
            arguments = match["arguments"].strip()
            if not _is_object(arguments):
                return None
            calls.append(ToolCall(match["name"].strip(), arguments))
            rest = rest.replace(match.group(0), "", 1)
        return calls if calls and not rest.strip() else None


def parse_tool_calls(text: str, parser: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output."""
    content, deltas = ToolCallSplitter(parser).push(text, is_last=True)
    return content, join_deltas(deltas)


def join_deltas(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The calls that streamed pieces make up, in index order."""
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.name is not None:
            names[delta.index] = delta.name
        arguments.setdefault(delta.index, []).append(delta.arguments)
    return [ToolCall(names[i], "".join(arguments[i])) for i in sorted(names)]


def _continues(sent: list[ToolCall], found: list[ToolCall]) -> bool:
    """Whether the parsed calls extend the announced ones (same names, arguments so far)."""
    return len(found) >= len(sent) and all(
        f.name == s.name and f.arguments.startswith(s.arguments)
        for s, f in zip(sent, found, strict=False)
    )


def _name(parser: str, raw: str) -> str | None:
    if parser == "deepseek_v3":
        return raw.strip() or None
    try:
        return json.loads(f'"{raw}"') or None
    except ValueError:
        return None


def _hermes_call(inner: str) -> ToolCall | None:
    """The call of a hermes block; its arguments' own text when they are an object written after
    the name (what streaming reads), else re-serialized."""
    header = FORMATS["hermes"].header.match(inner)
    if header is not None:
        try:
            _, end = json.JSONDecoder().raw_decode(inner, header.end())
        except ValueError:
            end = None
        if end is not None and _hermes_fields(inner) is not None:
            name = _name("hermes", header["name"])
            return None if name is None else ToolCall(name, inner[header.end() : end])
    fields = _hermes_fields(inner)
    if fields is None:
        return None
    name, arguments = fields
    if isinstance(arguments, str):
        return ToolCall(name, arguments.strip()) if _is_object(arguments) else None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _hermes_fields(inner: str) -> tuple[str, object] | None:
    try:
        call = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return call["name"], call.get("arguments", call.get("parameters", {}))


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
