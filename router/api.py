"""OpenAI request bodies (strict pydantic models) and OpenAI-style error responses.

Known fields are validated strictly: a wrong type is a 422, and so is an unknown field inside a
nested object (a message, `stream_options`). An unknown top-level field is ignored, as vLLM
ignores it, and named in the `x-duet-ignored-fields` response header, unless ignoring it would
change the result (`router.unknown_fields`): that is a 400, like a well-formed request the
server cannot honour (n > 1, max_tokens out of range, a prompt longer than the context). All
carry `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from control.errors import InvalidRequestError
from control.logprobs import MAX_LOGPROBS
from control.sampling_params import MAX_SEQUENCES, SamplingParams
from router.unknown_fields import CHAT, GENERATION_KINDS, PROMPT, ignored_fields_headers, refusal

log = logging.getLogger("router")

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
        self.headers: dict[str, str] = {}  # more response headers (the ignored fields)

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
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # Kinds of unknown top-level fields refused rather than ignored (router.unknown_fields).
    refused_kinds: ClassVar[frozenset[str]] = frozenset()
    # What a union field must be: its 422 says so, not which member failed first.
    type_hints: ClassVar[dict[str, str]] = {}


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    """Fields shared by both endpoints. The last six are extensions (vLLM's names)."""

    refused_kinds = GENERATION_KINDS
    type_hints = {"stop": "a string or a list of strings"}

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
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    # vLLM's: the logprob (and rank) of every prompt token after the first, and its k most
    # likely alternatives; not streamed.
    prompt_logprobs: int | None = None
    # Structured output (router.structured_output): OpenAI's response_format, vLLM's guided_*
    # and structured_outputs; at most one per request.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    """`prompt`: a text, token ids, or a batch of either (each prompt its own choice)."""

    type_hints = {
        **_SamplingFields.type_hints,
        "prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
    }
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # the OpenAI default for completions
    add_special_tokens: bool = True  # vLLM's: bos first (when the tokenizer adds one)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallPart(_Strict):
    """A call an earlier assistant message made (the history of a tool loop)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallPart] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    def as_template_dict(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_SamplingFields):
    refused_kinds = GENERATION_KINDS | {CHAT}

    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = False  # vLLM's: the template writes its own bos
    max_completion_tokens: int | None = None
    # Extra variables of the chat template (e.g. {"thinking": true} for DeepSeek-V3.1-style
    # templates), as vLLM passes them.
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the template's generation prompt (the assistant's header) ends the prompt.
    add_generation_prompt: bool = True
    # vLLM's: the final message is left open (no end of turn), the model continues it; needs
    # add_generation_prompt false.
    continue_final_message: bool = False
    # vLLM's: with the last message in the reply's role (assistant, or with
    # add_generation_prompt false the last one's own), its content starts every choice's.
    echo: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None
    # Tool calling (router.tools): OpenAI's function tools, checked there.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


class TokenizeCompletionRequest(_Strict):
    """vLLM's `POST /tokenize` of a raw prompt."""

    refused_kinds = frozenset({PROMPT})

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """vLLM's `POST /tokenize` of a chat: the ids `/v1/chat/completions` would prefill."""

    refused_kinds = frozenset({PROMPT, CHAT})

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # as on chat: the final message left open
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """vLLM's `POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


def parse_body(raw: bytes, model: type[_Strict]) -> tuple[Any, list[str]]:
    """JSON bytes -> (validated request model, names of the unknown top-level fields ignored);
    ApiError 400 (not JSON, or an unknown field that cannot be ignored) or 422 (bad fields).
    Every error raised after the unknown fields are known carries their header too."""
    return validate_body(load_object(raw), model)


def parse_tokenize_body(raw: bytes) -> tuple[TokenizeCompletionRequest | TokenizeChatRequest, list]:
    """A `/tokenize` body: a chat when it has `messages`, else a raw prompt."""
    data = load_object(raw)
    model = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
    return validate_body(data, model)


def load_object(raw: bytes) -> dict[str, Any]:
    data = load_json(raw)
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return data


def validate_body(data: dict[str, Any], model: type[_Strict]) -> tuple[Any, list[str]]:
    known = {name for name in data if name in model.model_fields}
    ignored = [name for name in data if name not in known]
    headers = ignored_fields_headers(ignored)
    if ignored:
        log.debug("ignored unknown request fields: %s", ", ".join(map(repr, ignored[:50])))
    for name in ignored:
        why = refusal(name, data[name], model.refused_kinds)
        if why is not None:
            raise _with_headers(ApiError(400, why, param=name, code="unsupported"), headers)
    try:
        body = model.model_validate({name: data[name] for name in known})
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        hint = model.type_hints.get(err["loc"][0]) if err["loc"] else None
        if hint is not None and err["type"] != "missing":
            param, message = str(err["loc"][0]), f"{err['loc'][0]}: must be {hint}"
        elif err["type"] == "extra_forbidden":
            message = f"unknown field '{param}'"
        elif err["type"] == "missing":
            message = f"missing required field '{param}'"
        else:
            message = f"{param}: {err['msg']}"
        error = ApiError(422, message, param=param, code="invalid_type")
        raise _with_headers(error, headers) from None
    return body, ignored


def _with_headers(error: ApiError, headers: dict[str, str]) -> ApiError:
    error.headers.update(headers)
    return error


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


def sequences(body: _SamplingFields) -> tuple[int, int]:
    """(n, best_of) of a request: the choices returned per prompt, and the sequences generated
    per prompt (completions' `best_of`, the n with the highest cumulative logprob are
    returned). ApiError 400 for values out of range, and for best_of > n streamed (the choice
    is only known at the end, as OpenAI and vLLM refuse it too)."""
    n = body.n
    if not 1 <= n <= MAX_SEQUENCES:
        raise ApiError(
            400, f"n must be in [1, {MAX_SEQUENCES}], got {n}", param="n", code="invalid_value"
        )
    best_of = body.best_of if isinstance(body, CompletionRequest) else None
    if best_of is None:
        return n, n
    if not n <= best_of <= MAX_SEQUENCES:
        raise ApiError(
            400,
            f"best_of must be in [n = {n}, {MAX_SEQUENCES}], got {best_of}",
            param="best_of",
            code="invalid_value",
        )
    if best_of > n and body.stream:
        raise ApiError(
            400,
            "best_of > n cannot be streamed (the best are known only at the end)",
            param="best_of",
            code="invalid_value",
        )
    return n, best_of


def check_common(body: _SamplingFields) -> None:
    """Values the schema accepts but this server does not support: 400."""
    sequences(body)
    _check_num_logprobs("prompt_logprobs", body.prompt_logprobs)
    if body.prompt_logprobs is not None and body.stream:  # vLLM refuses it too
        raise ApiError(
            400,
            "prompt_logprobs: not available when streaming",
            param="prompt_logprobs",
            code="invalid_value",
        )
    if isinstance(body, CompletionRequest):
        _check_num_logprobs("logprobs", body.logprobs)
        # suffix (fill-in-the-middle, control.fim; "" is no suffix) wraps a text prompt.
        if body.suffix and body.echo:
            raise ApiError(
                400,
                "suffix: cannot be combined with echo (as OpenAI refuses it)",
                param="suffix",
                code="invalid_value",
            )
        prompt = body.prompt
        if body.suffix and isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
            raise ApiError(
                400,
                "suffix: needs a text prompt; a prompt of token ids has no text to put between "
                "the fill-in-the-middle tokens (send the whole FIM prompt's ids instead)",
                param="suffix",
                code="invalid_value",
            )
    if isinstance(body, ChatCompletionRequest):
        _check_num_logprobs("top_logprobs", body.top_logprobs)
        if body.top_logprobs and not body.logprobs:
            raise ApiError(
                400,
                "top_logprobs: requires logprobs to be true",
                param="top_logprobs",
                code="invalid_value",
            )


def _check_num_logprobs(param: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(
            400,
            f"{param} must be in [0, {MAX_LOGPROBS}], got {value}",
            param=param,
            code="invalid_value",
        )


def logprob_fields(body: _SamplingFields) -> dict[str, int | None]:
    """The SamplingParams logprob fields a request asks for: completions `logprobs: k` (and,
    with `echo`, the same for the prompt); chat `logprobs: true` with `top_logprobs: k`;
    `prompt_logprobs: k` for the prompt (the larger k when echo asks too: each shows its own)."""
    prompt = body.prompt_logprobs
    if isinstance(body, CompletionRequest):
        if body.echo and body.logprobs is not None:
            prompt = body.logprobs if prompt is None else max(prompt, body.logprobs)
        return {"logprobs": body.logprobs, "prompt_logprobs": prompt}
    if isinstance(body, ChatCompletionRequest) and body.logprobs:
        return {"logprobs": body.top_logprobs or 0, "prompt_logprobs": prompt}
    return {"logprobs": None, "prompt_logprobs": prompt}


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
    vocab_size: int,
    structured: tuple[str, ...] | None = None,
) -> SamplingParams:
    """The request's SamplingParams; `max_tokens` None means "up to the context end".

    max_tokens must be in [1, max_tokens_limit]; it is then clipped to the room left in the
    context (the request ends with finish_reason "length" there, as the nodes do), and so is
    min_tokens, which must not exceed max_tokens. logit_bias keys must be token ids in
    [0, vocab_size). `structured`: the checked (kind, spec) of `router.structured_output`.
    """
    room = max_positions - prompt_len
    if max_tokens is None:
        max_tokens = min(room, max_tokens_limit)
    elif not 1 <= max_tokens <= max_tokens_limit:
        raise ApiError(
            400,
            f"max_tokens must be in [1, {max_tokens_limit}], got {max_tokens}",
            param="max_tokens",
            code="invalid_value",
        )
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
    if body.min_tokens > max_tokens:
        raise ApiError(
            400,
            f"min_tokens must be at most max_tokens ({max_tokens}), got {body.min_tokens}",
            param="min_tokens",
            code="invalid_value",
        )
    max_new_tokens = max(1, min(max_tokens, room))
    n, best_of = sequences(body)
    logprobs = logprob_fields(body)
    if best_of > n and logprobs["logprobs"] is None:  # the ranking needs each token's logprob
        logprobs["logprobs"] = 0
    try:
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            seed=body.seed,
            max_new_tokens=max_new_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            min_p=0.0 if body.min_p is None else body.min_p,
            min_tokens=min(body.min_tokens, max_new_tokens),
            logit_bias=_logit_bias(body.logit_bias or {}, vocab_size),
            n=best_of,
            **logprobs,
            structured=structured,
        )
        params.check_vocab(vocab_size)
    except InvalidRequestError as exc:
        name = str(exc).split(" ", 1)[0].rstrip(":")  # the messages start with the field
        param = name if name in _SamplingFields.model_fields else None
        raise ApiError(400, str(exc), param=param, code="invalid_value") from None
    return params


def _logit_bias(raw: dict[str, float], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} -> (id, bias) pairs; the values are checked by
    SamplingParams."""
    pairs = []
    for key, bias in raw.items():
        if not (key.isascii() and key.isdigit()):
            raise ApiError(
                400,
                f"logit_bias: the key {key!r} is not a token id (a decimal integer)",
                param="logit_bias",
                code="invalid_value",
            )
        # A key longer than any id is outside the vocabulary (and int() of it could be slow).
        pairs.append((int(key) if len(key) <= 12 else vocab_size, bias))
    return tuple(pairs)
