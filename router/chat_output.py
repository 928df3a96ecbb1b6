"""One chat choice's output as the client sees it: the reasoning split off first
(`router.reasoning`), then tool calls found in the rest (`router.tool_parsers`), each delta
turned into the chat delta's fields. Streamed, a call's arguments come in pieces (OpenAI's
shape: the first piece of a call carries its index, id, type and name, the later ones its index
and an arguments piece); whole, each call comes in one piece."""

from __future__ import annotations

import secrets
from typing import Any

from router.reasoning import ReasoningSplitter
from router.tool_parsers import ToolCallDelta, ToolCallSplitter


class ChatOutput:
    def __init__(self, reasoning_parser: str = "", tool_parser: str = "", stream: bool = False):
        self.reasoning = ReasoningSplitter(reasoning_parser) if reasoning_parser else None
        self.tools = ToolCallSplitter(tool_parser, stream_arguments=stream) if tool_parser else None
        self.reasoning_tokens = 0  # the output tokens that came while it was still reasoning
        self._call_ids: dict[int, str] = {}

    def push(self, delta: str, num_tokens: int, is_last: bool) -> dict[str, Any]:
        """The chat delta's fields for the next text delta (of `num_tokens` tokens): any of
        `reasoning_content`, `content`, `tool_calls`, the empty ones left out."""
        reasoning, content = "", delta
        if self.reasoning is not None:
            if self.reasoning.in_reasoning:
                self.reasoning_tokens += num_tokens
            reasoning, content = self.reasoning.push(delta, is_last)
        calls: list[ToolCallDelta] = []
        if self.tools is not None and not (self.reasoning and self.reasoning.in_reasoning):
            content, calls = self.tools.push(content, is_last)
        out: dict[str, Any] = {"reasoning_content": reasoning, "content": content}
        out = {key: text for key, text in out.items() if text}
        if calls:
            out["tool_calls"] = [self._call(call) for call in _merged(calls)]
        return out

    def _call(self, piece: ToolCallDelta) -> dict[str, Any]:
        if piece.name is None:
            return {"index": piece.index, "function": {"arguments": piece.arguments}}
        call_id = self._call_ids[piece.index] = f"call_{secrets.token_hex(12)}"
        function = {"name": piece.name, "arguments": piece.arguments}
        return {"index": piece.index, "id": call_id, "type": "function", "function": function}

    @property
    def num_calls(self) -> int:
        return len(self._call_ids)

    def finish_reason(self, finish: str | None) -> str | None:
        """A choice that stopped after calling tools finished with "tool_calls" (OpenAI's)."""
        return "tool_calls" if finish == "stop" and self.num_calls else finish


def _merged(pieces: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call as one (a delta names each call once)."""
    out: list[ToolCallDelta] = []
    for piece in pieces:
        if out and out[-1].index == piece.index:
            last = out[-1]
            out[-1] = ToolCallDelta(piece.index, last.name, last.arguments + piece.arguments)
        else:
            out.append(piece)
    return out


def join_calls(pieces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A choice's streamed `tool_calls` pieces -> its whole calls (id, type, function), in
    index order: what the non-streamed message holds."""
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        call = calls.get(piece["index"])
        if call is None:
            calls[piece["index"]] = {k: v for k, v in piece.items() if k != "index"}
            calls[piece["index"]]["function"] = dict(piece["function"])
        else:
            call["function"]["arguments"] += piece["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]
