"""The OpenAI response bodies of completions and chat: whole, streamed chunks, the usage, and
the error of a request whose router request failed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from router.api import ApiError
from router.state import ErrorEvent


class RequestFailed(Exception):
    """Prompt `index`'s router request ended with `event`."""

    def __init__(self, index: int, event: ErrorEvent):
        super().__init__(event.message)
        self.index = index
        self.event = event


@dataclass(frozen=True)
class ResponseShapes:
    """The OpenAI response shapes of one request; choice `index` = prompt position."""

    request_id: str
    model: str
    chat: bool
    prompt_lens: tuple[int, ...]
    is_batch: bool = False
    n: int = 1  # choices per prompt
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: the alternatives asked for
    # The reply's role: the last message's when the chat adds no generation prompt (vLLM's).
    role: str = "assistant"
    created: int = field(default_factory=lambda: int(time.time()))  # the same in every chunk

    def _base(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
        }

    def usage(
        self, num_outputs: list[int], reasoning_tokens: int | None = None, cached_tokens: int = 0
    ) -> dict:
        """OpenAI's usage; `cached_tokens`: the prompt tokens served from the prefill nodes'
        prefix caches (`prompt_tokens_details`, as OpenAI and vLLM report them)."""
        num_prompt, num_output = sum(self.prompt_lens), sum(num_outputs)
        usage: dict[str, Any] = {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_output,
            "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }
        if reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage

    def chunk(
        self,
        index: int,
        delta: str | dict[str, str],
        finish: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            content = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": index, "delta": content, "logprobs": logprobs}
            choice["finish_reason"] = finish
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(
        self, num_outputs: list[int], reasoning_tokens: int | None = None, cached_tokens: int = 0
    ) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        usage = self.usage(num_outputs, reasoning_tokens, cached_tokens)
        return {**self._base(obj), "choices": [], "usage": usage}

    def full(
        self,
        choices: list[dict[str, Any]],
        num_outputs: list[int],
        reasoning_tokens=None,
        cached_tokens: int = 0,
    ) -> dict[str, Any]:
        """The whole response: `choices` (text, finish_reason, logprobs each; with a reasoning
        or tool parser, reasoning_content and tool_calls) in index order; `num_outputs`: the tokens of every sequence
        generated (shown or not)."""
        if self.chat:
            out = [
                {
                    "index": i,
                    "message": _message(c, self.role),
                    "logprobs": c["logprobs"],
                    "finish_reason": c["finish_reason"],
                }
                for i, c in enumerate(choices)
            ]
            base = self._base("chat.completion")
            if self.prompt_logprobs is not None:  # vLLM's: one prompt, at the top
                base["prompt_logprobs"] = choices[0]["prompt_logprobs"] if choices else None
        else:
            keys = ["index", "text", "logprobs", "finish_reason"]
            if self.prompt_logprobs is not None:  # vLLM's: each choice its prompt's
                keys.append("prompt_logprobs")
            out = [{"index": i, **c} for i, c in enumerate(choices)]
            out = [{k: c[k] for k in keys} for c in out]
            base = self._base("text_completion")
        usage = self.usage(num_outputs, reasoning_tokens, cached_tokens)
        return {**base, "choices": out, "usage": usage}

    def error(self, exc: RequestFailed) -> ApiError:
        where = f"prompt[{exc.index}]: " if self.is_batch else ""
        message = f"{where}{exc.event.message}"
        return ApiError(500, message, code=f"failed_at_{exc.event.stage}")


def _message(choice: dict[str, Any], role: str) -> dict[str, Any]:
    message = {"role": role, "content": choice["text"]}
    if "reasoning_content" in choice:
        message["reasoning_content"] = choice["reasoning_content"]
    if "tool_calls" in choice:  # OpenAI's: a message of calls alone has null content
        message["content"] = choice["text"] or None
        message["tool_calls"] = choice["tool_calls"]
    return message
