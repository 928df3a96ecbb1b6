"""OpenAI request bodies (strict pydantic models) and OpenAI-style error responses.

Bodies are validated strictly: a wrong type or an unknown field is a 422 (a misspelt
`max_token` silently ignored would matter); a well-formed request the server cannot honour
(n > 1, max_tokens out of range, a prompt longer than the context) is a 400. Both carry
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams

MAX_STOP_STRINGS = 4
MAX_JSON_DEPTH = 64  # OpenAI bodies nest a few levels; deeper is an attack, not a request
MAX_TOKEN_ID = 2**31 - 1  # top_k and stop_token_ids beyond int32 cannot mean anything


class ApiError(Exception):
    """An error response: status, one-line message, OpenAI `type`, `param` and `code`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = _text(message, 2000)
        self.param = None if param is None else _text(param, 200)
        self.code = code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        if self.status == 404:
            return "not_found_error"
        if self.status == 429:
            return "rate_limit_error"
        if 400 <= self.status < 500:  # 401 too, as OpenAI does (code "invalid_api_key")
            return "invalid_request_error"
        if self.status == 503:
            return "service_unavailable_error"
        return "server_error"

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    """Fields shared by both endpoints. The last three are extensions (vLLM's names)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16  # the OpenAI default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


def parse_body(raw: bytes, model: type[_Strict]) -> Any:
    """JSON bytes -> validated request model; ApiError 400 (not JSON) or 422 (bad fields)."""
    data = load_json(raw)
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            message = f"unknown field '{param}'"
        elif err["type"] == "missing":
            message = f"missing required field '{param}'"
        else:
            message = f"{param}: {err['msg']}"
        raise ApiError(422, message, param=param, code="invalid_type") from None


def load_json(raw: bytes) -> Any:
    """Strict JSON (RFC 8259) of a request body, or ApiError 400: UTF-8 only, no NaN or
    Infinity, finite numbers, no unpaired surrogate escapes (no text can hold them), nesting at
    most MAX_JSON_DEPTH deep."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = f"{exc.reason} at byte {exc.start}"
        raise _invalid_json(f"the body is not valid UTF-8 ({reason})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise _invalid_json(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, a non-finite number, a too-long integer
        raise _invalid_json(f"the body is not valid JSON ({exc})") from None
    _check_tree(data)
    return data


def _invalid_json(message: str) -> ApiError:
    return ApiError(400, message, code="invalid_json")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"the number {literal[:40]} is out of range")
    return value


def _check_tree(data: Any) -> None:
    """Depth and strings of a parsed document, without recursion."""
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_string(value)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise _invalid_json(f"the body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            for key in value:
                _check_string(key)
            value = value.values()
        stack.extend((item, depth + 1) for item in value)


def _check_string(value: str) -> None:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _invalid_json("the body holds an unpaired UTF-16 surrogate escape") from None


def _text(value: str, max_len: int) -> str:
    """`value` fit for an error body: valid UTF-8, at most `max_len` characters (messages quote
    what the client sent)."""
    value = value.encode("utf-8", "replace").decode("utf-8")
    return value if len(value) <= max_len else value[: max_len - 3] + "..."


def _unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param, code="unsupported")


def check_common(body: _SamplingFields) -> None:
    """Values the schema accepts but this server does not support: 400."""
    if body.n != 1:
        raise _unsupported("n", "only n=1 is supported")
    if body.presence_penalty != 0.0 or body.frequency_penalty != 0.0:
        raise _unsupported("presence_penalty", "penalties are not supported")
    if body.logit_bias:
        raise _unsupported("logit_bias", "logit_bias is not supported")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise _unsupported("echo", "echo is not supported")
        if body.logprobs is not None:
            raise _unsupported("logprobs", "logprobs are not supported")
        if body.best_of not in (None, 1):
            raise _unsupported("best_of", "only best_of=1 is supported")
        if body.suffix:
            raise _unsupported("suffix", "suffix is not supported")
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs or body.top_logprobs:
            raise _unsupported("logprobs", "logprobs are not supported")
        if body.tools or body.tool_choice not in (None, "none"):
            raise _unsupported("tools", "tool calls are not supported")
        if body.response_format and body.response_format.get("type") != "text":
            raise _unsupported("response_format", "only the text format is supported")


def stop_strings(body: _SamplingFields) -> list[str]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings", param="stop")
    if any(s == "" for s in stop):
        raise ApiError(400, "stop: a stop string must not be empty", param="stop")
    return stop


def sampling_params(
    body: _SamplingFields,
    max_tokens: int | None,
    prompt_len: int,
    max_positions: int,
    max_tokens_limit: int,
) -> SamplingParams:
    """The request's SamplingParams; `max_tokens` None means "up to the context end".

    max_tokens must be in [1, max_tokens_limit]; it is then clipped to the room left in the
    context (the request ends with finish_reason "length" there, as the nodes do).
    """
    room = max_positions - prompt_len
    if max_tokens is None:
        max_tokens = min(room, max_tokens_limit)
    elif not 1 <= max_tokens <= max_tokens_limit:
        raise ApiError(
            400, f"max_tokens must be in [1, {max_tokens_limit}], got {max_tokens}",
            param="max_tokens", code="invalid_value",
        )  # fmt: skip
    if body.top_k is not None and body.top_k > MAX_TOKEN_ID:
        raise ApiError(
            400, f"top_k must be at most {MAX_TOKEN_ID}", param="top_k", code="invalid_value"
        )
    if any(not 0 <= t <= MAX_TOKEN_ID for t in body.stop_token_ids or ()):
        raise ApiError(
            400,
            f"stop_token_ids: every id must be in [0, {MAX_TOKEN_ID}]",
            param="stop_token_ids",
            code="invalid_value",
        )
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            seed=body.seed,
            max_new_tokens=max(1, min(max_tokens, room)),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
        )
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), code="invalid_value") from None
