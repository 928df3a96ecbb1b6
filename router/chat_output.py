"""One chat choice's output as the client sees it: the reasoning split off first
(`router.reasoning`), then tool calls found in the rest (`router.tool_parsers`), each delta
turned into the chat delta's fields."""

from __future__ import annotations

import secrets
from typing import Any

from router.reasoning import ReasoningSplitter
from router.tool_parsers import ToolCall, ToolCallSplitter


class ChatOutput:
    def __init__(self, reasoning_parser: str = "", tool_parser: str = ""):
        self.reasoning = ReasoningSplitter(reasoning_parser) if reasoning_parser else None
        self.tools = ToolCallSplitter(tool_parser) if tool_parser else None
        self.reasoning_tokens = 0  # the output tokens that came while it was still reasoning
        self.num_calls = 0

    def push(self, delta: str, num_tokens: int, is_last: bool) -> dict[str, Any]:
        """The chat delta's fields for the next text delta (of `num_tokens` tokens): any of
        `reasoning_content`, `content`, `tool_calls`, the empty ones left out."""
        reasoning, content = "", delta
        if self.reasoning is not None:
            if self.reasoning.in_reasoning:
                self.reasoning_tokens += num_tokens
            reasoning, content = self.reasoning.push(delta, is_last)
        calls: list[ToolCall] = []
        if self.tools is not None and not (self.reasoning and self.reasoning.in_reasoning):
            content, calls = self.tools.push(content, is_last)
        out: dict[str, Any] = {"reasoning_content": reasoning, "content": content}
        out = {key: text for key, text in out.items() if text}
        if calls:
            out["tool_calls"] = [self._call(call) for call in calls]
        return out

    def _call(self, call: ToolCall) -> dict[str, Any]:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        function = {"name": call.name, "arguments": call.arguments}
        call_id = f"call_{secrets.token_hex(12)}"
        return {"index": index, "id": call_id, "type": "function", "function": function}

    def finish_reason(self, finish: str | None) -> str | None:
        """A choice that stopped after calling tools finished with "tool_calls" (OpenAI's)."""
        return "tool_calls" if finish == "stop" and self.num_calls else finish
