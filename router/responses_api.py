"""OpenAI's Responses API (`POST /v1/responses`), stateless, over the chat path: the request's
`input` items become chat messages (instructions first, function calls and their outputs as the
assistant's tool calls and tool messages), the chat machinery serves them (reasoning and tool
parsers included), and its output becomes the response's items (reasoning, message,
function_call), whole or as the typed stream events the official client reads.

Nothing is stored: `store` is accepted and ignored, `previous_response_id` is a 400 (send the
conversation in `input` instead).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from router.api import ApiError, ChatCompletionRequest, _Strict, validate_body
from router.response_shapes import RequestFailed
from router.serving import Prompts, Serving

log = logging.getLogger("router")

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | ...}}
    store: bool | None = None  # accepted; nothing is stored
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None  # accepted; the model reasons as it does
    metadata: dict[str, Any] | None = None
    user: str | None = None
    # vLLM's extensions, as on chat
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves `body`; 400 naming the field for what cannot be served."""
    if body.previous_response_id is not None:
        raise _invalid(
            "previous_response_id", "responses are not stored: send the conversation in input"
        )
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        "max_completion_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls,
        "ignore_eos": body.ignore_eos,
        "stream": body.stream,  # streamed: a call's arguments come in pieces
    }
    for name in ("temperature", "top_p", "user", "top_k", "min_p", "repetition_penalty", "seed"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.tools is not None:
        chat["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(body.tools)]
    if isinstance(body.tool_choice, dict):
        if body.tool_choice.get("type") != "function" or "name" not in body.tool_choice:
            raise _invalid("tool_choice", 'a named choice is {"type": "function", "name": ...}')
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice["name"]}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    response_format = _response_format(body.text)
    if response_format is not None:
        chat["response_format"] = response_format
    return validate_body(chat, ChatCompletionRequest)[0]


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not items:
        raise _invalid("input", "must not be empty")
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise _invalid("input", f"input[{i}].role must be one of {', '.join(ROLES)}")
            messages.append({"role": role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = _call(item, i)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise _invalid("input", f"input[{i}] needs a call_id and an output string")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind != "reasoning":  # an earlier turn's reasoning is not fed back
            raise _invalid("input", f"input[{i}]: items of type {kind!r} are not supported")
    return messages


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid("input", f"input[{i}].content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            raise _invalid("input", f"input[{i}].content[{j}]: only text parts are supported")
        if not isinstance(part.get("text"), str):
            raise _invalid("input", f"input[{i}].content[{j}].text must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _call(item: dict[str, Any], i: int) -> dict[str, Any]:
    fields = [item.get(k) for k in ("call_id", "name", "arguments")]
    if not all(isinstance(f, str) for f in fields):
        raise _invalid("input", f"input[{i}]: a function_call needs call_id, name, arguments")
    call_id, name, arguments = fields
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise _invalid("tools", f"tools[{i}]: only function tools are supported")
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise _invalid("text", "text.format.type must be text, json_object or json_schema")


class ResponseBuilder:
    """The response of one request as its output arrives: the whole object, or (`events`) the
    stream of typed events, each numbered."""

    def __init__(self, body: ResponsesRequest, model: str, input_tokens: int):
        self.body = body
        self.model = model
        self.input_tokens = input_tokens
        self.cached_tokens = 0  # of the input, served from a prefill node's cache (at the end)
        self.id = f"resp_{secrets.token_hex(12)}"
        self.created_at = int(time.time())
        self.items: list[dict[str, Any]] = []  # output items, the last one maybe still open
        self._open: dict[str, Any] | None = None
        self._seq = 0

    # ---- events --------------------------------------------------------------------------
    def push(self, delta: str | dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta (a text, or a chat parser's fields)."""
        fields = {"content": delta} if isinstance(delta, str) else delta
        events = []
        if fields.get("reasoning_content"):
            events += self._text("reasoning", fields["reasoning_content"])
        if fields.get("content"):
            events += self._text("message", fields["content"])
        for piece in fields.get("tool_calls", []):
            if "id" in piece:  # a new call: its name, maybe its first arguments
                events += self._close()
                events += self._open_call(piece["function"]["name"])
            events += self._arguments(piece["function"]["arguments"])
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._open_item(kind)
        item, index = self._open, len(self.items) - 1
        part = item["content"][0]
        part["text"] += text
        if kind == "reasoning":
            name, extra = "response.reasoning_text.delta", {}
        else:
            name, extra = "response.output_text.delta", {"logprobs": []}
        events.append(
            self._event(
                name, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra
            )
        )
        return events

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item = {
                "type": "reasoning",
                "id": f"rs_{secrets.token_hex(12)}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
                "status": "in_progress",
            }
        else:
            item = {
                "type": "message",
                "id": f"msg_{secrets.token_hex(12)}",
                "role": "assistant",
                "status": "in_progress",
                "content": [{"type": "output_text", "text": "", "annotations": []}],
            }
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        shown = {**item, "content": [] if kind == "message" else item["content"]}
        events = [self._event("response.output_item.added", output_index=index, item=shown)]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        return events

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        index = len(self.items) - 1
        if item["type"] == "function_call":
            where = {"item_id": item["id"], "output_index": index}
            arguments, name = item["arguments"], item["name"]
            end = "response.function_call_arguments.done"
            events = [self._event(end, **where, arguments=arguments, name=name)]
            return [
                *events,
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            events = [self._event("response.reasoning_text.done", **where, text=part["text"])]
        else:
            events = [
                self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **where, part=part),
            ]
        return [*events, self._event("response.output_item.done", output_index=index, item=item)]

    def _open_call(self, name: str) -> list[dict[str, Any]]:
        item = {
            "type": "function_call",
            "id": f"fc_{secrets.token_hex(12)}",
            "call_id": f"call_{secrets.token_hex(12)}",
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        return [self._event("response.output_item.added", output_index=index, item=dict(item))]

    def _arguments(self, piece: str) -> list[dict[str, Any]]:
        item = self._open
        if not piece or item is None or item["type"] != "function_call":
            return []
        item["arguments"] += piece
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        return [self._event("response.function_call_arguments.delta", **where, delta=piece)]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start_events(self) -> list[dict[str, Any]]:
        shown = self.response("in_progress", None, 0, None)
        return [
            self._event("response.created", response=shown),
            self._event("response.in_progress", response=shown),
        ]

    def end_events(self, finish: str | None, output_tokens: int, reasoning: int | None):
        events = self._close()
        status = "incomplete" if finish == "length" else "completed"
        whole = self.response(status, finish, output_tokens, reasoning)
        return [*events, self._event(f"response.{status}", response=whole)]

    def error_event(self, code: str, message: str) -> dict[str, Any]:
        return self._event("error", code=code, message=message, param=None)

    # ---- the object ----------------------------------------------------------------------
    def response(
        self, status: str, finish: str | None, output_tokens: int, reasoning: int | None
    ) -> dict[str, Any]:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": [dict(item) for item in self.items],
            "incomplete_details": incomplete,
            "error": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "parallel_tool_calls": body.parallel_tool_calls,
            "text": body.text or {"format": {"type": "text"}},
            "reasoning": body.reasoning,
            "metadata": body.metadata or {},
            "store": False,
            "previous_response_id": None,
            "truncation": "disabled",
            "user": body.user,
            "usage": {
                "input_tokens": self.input_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning or 0},
                "total_tokens": self.input_tokens + output_tokens,
            },
        }


async def respond(
    serving: Serving, request: Request, body: ResponsesRequest
) -> dict[str, Any] | AsyncIterator[str]:
    """The whole response, or (with `stream`) its SSE lines."""
    chat = chat_request(body)
    args = (chat.messages, True, chat.add_special_tokens, None, chat.tools)
    ids = serving.chat_prompt(*args)
    builder = ResponseBuilder(body, serving.model.name, len(ids))
    subs, _, _ = await serving.start(chat, Prompts([ids]), builder.id)
    (sub,) = subs
    if body.stream:
        return _stream(serving, request, sub, builder)
    finish = None
    try:
        async with contextlib.aclosing(serving.outputs(request, subs)) as events:
            async for _, delta, finish_now, _ in events:
                builder.push(delta)
                finish = finish_now or finish
    except RequestFailed as exc:
        raise ApiError(500, exc.event.message, code=f"failed_at_{exc.event.stage}") from None
    builder.cached_tokens = sub.req.cached_tokens
    builder.end_events(finish, sub.num_output_tokens, _reasoning(sub))
    status = "incomplete" if finish == "length" else "completed"
    return builder.response(status, finish, sub.num_output_tokens, _reasoning(sub))


async def _stream(
    serving: Serving, request: Request, sub: Any, builder: ResponseBuilder
) -> AsyncIterator[str]:
    for event in builder.start_events():
        yield _sse(event)
    finish = None
    try:
        async with contextlib.aclosing(serving.outputs(request, [sub])) as events:
            async for _, delta, finish_now, _ in events:
                for event in builder.push(delta):
                    yield _sse(event)
                finish = finish_now or finish
        builder.cached_tokens = sub.req.cached_tokens
        for event in builder.end_events(finish, sub.num_output_tokens, _reasoning(sub)):
            yield _sse(event)
    except RequestFailed as exc:
        yield _sse(builder.error_event(f"failed_at_{exc.event.stage}", exc.event.message))
    except Exception:  # a bug here still ends the stream with an error event, never silence
        log.exception("streaming %s failed", builder.id)
        yield _sse(builder.error_event("internal", "internal error while streaming"))


def _reasoning(sub) -> int | None:
    output = sub.output
    return None if output is None or output.reasoning is None else output.reasoning_tokens


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
