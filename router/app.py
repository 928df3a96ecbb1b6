"""The OpenAI-compatible HTTP gateway (FastAPI): completions and chat completions (SSE streaming
or one JSON body), models, health and Prometheus metrics, over a `Router`.

Every accepted request ends with a completion or an error: a failure mid-stream is sent as a
`data: {"error": ...}` event (the openai client raises it); a client that disconnects has its
request aborted on both nodes at once. API keys, per-key concurrency and the body size are
checked in front of every route (`router.guard`); client input never gets a 5xx: a 5xx means
the server failed (503 no node or overload, 500 a node failing mid-request).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import ConfigError, InvalidRequestError
from engine.generate import validate_prompt
from engine.tokenizer import Tokenizer
from router.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_common,
    parse_body,
    sampling_params,
    stop_strings,
)
from router.auth import ApiKeys, KeyLimiter
from router.core import Router, RouterError
from router.guard import GatewayGuard
from router.metrics import CONTENT_TYPE
from router.state import ErrorEvent, RouterRequest
from router.text import TextStream

log = logging.getLogger("router")


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the id clients pass as `model`
    path: str
    vocab_size: int
    max_positions: int


class RequestFailed(Exception):
    def __init__(self, event: ErrorEvent):
        super().__init__(event.message)
        self.event = event


def create_app(router: Router, tokenizer: Tokenizer, model: ModelInfo) -> FastAPI:
    """The gateway over `router`; ConfigError for a bad `[security]` key setting."""
    security = router.cfg.security
    keys = ApiKeys.load(security)
    limiter = KeyLimiter(router.cfg.router.max_concurrent_per_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if keys.is_open:
            log.warning("no API keys configured: the HTTP API is open to every client")
        else:
            metrics_access = "needs a key" if security.metrics_need_key else "is open"
            log.info(
                "%d API key(s) loaded; /health is open, /metrics %s", keys.num_keys, metrics_access
            )
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="duet-serve router", lifespan=lifespan)
    app.state.router = router
    app.state.limiter = limiter
    app.add_middleware(
        GatewayGuard,
        keys=keys,
        limiter=limiter,
        metrics=router.metrics,
        max_body_bytes=router.cfg.router.max_body_bytes,
        metrics_need_key=security.metrics_need_key,
    )
    serving = _Serving(router, tokenizer, model)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return ApiError(422, str(exc.errors()[0].get("msg", "invalid request"))).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        # A bug, never client input: still an OpenAI error body (the traceback is logged).
        return ApiError(500, f"internal error ({type(exc).__name__})").response()

    @app.get("/health")
    async def health():
        nodes = router.nodes.summary()
        all_ready = all(n["status"] == "ready" for n in nodes.values())
        status = "ok" if all_ready else ("degraded" if router.is_serving else "unavailable")
        body = {"status": status, "ratio": router.cfg.ratio, "nodes": nodes}
        return JSONResponse(body, status_code=200 if router.is_serving else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": model.name,
            "object": "model",
            "created": 0,
            "owned_by": "duet-serve",
            "max_model_len": model.max_positions,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(await request.body(), CompletionRequest)
        return await serving.run(request, body, serving.completion_prompt(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(await request.body(), ChatCompletionRequest)
        return await serving.run(request, body, serving.chat_prompt(body), chat=True)

    return app


class _Serving:
    """Turns a validated body into a router request and its HTTP response."""

    def __init__(self, router: Router, tokenizer: Tokenizer, model: ModelInfo):
        self.router = router
        self.tokenizer = tokenizer
        self.model = model

    # ---- prompts ---------------------------------------------------------------------------
    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "the prompt is empty", param="prompt")
            # Exactly as `duet generate --prompt` tokenizes, so outputs can be compared.
            return self.tokenizer.encode_prompt(prompt)
        return list(prompt)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = [m.as_template_dict() for m in body.messages]
        try:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        except (ValueError, ConfigError) as exc:
            raise ApiError(400, f"messages: {exc}", param="messages") from None

    # ---- one request -----------------------------------------------------------------------
    async def run(self, request: Request, body, prompt_ids: list[int], chat: bool):
        if body.model is not None and body.model not in (self.model.name, self.model.path):
            raise ApiError(
                404, f"the model '{body.model}' does not exist (this server has "
                f"'{self.model.name}')", param="model", code="model_not_found",
            )  # fmt: skip
        check_common(body)
        stop = stop_strings(body)
        try:
            validate_prompt(prompt_ids, self.model.vocab_size, self.model.max_positions)
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), param="prompt", code="invalid_prompt") from None
        self._check_prompt_limit(len(prompt_ids))
        max_tokens = body.max_tokens
        if chat and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        limit = self.router.cfg.router.max_tokens_limit
        sampling = sampling_params(
            body, max_tokens, len(prompt_ids), self.model.max_positions, limit
        )
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            req = await self.router.submit(request_id, prompt_ids, sampling)
        except RouterError as exc:
            raise ApiError(
                exc.status, exc.message, code=exc.code, retry_after=exc.retry_after
            ) from None
        fmt = _Format(request_id, self.model.name, chat, len(prompt_ids))
        text = TextStream(self.tokenizer, stop)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            stream = self._sse(request, req, text, fmt, usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        return await self._complete(request, req, text, fmt)

    def _check_prompt_limit(self, prompt_len: int) -> None:
        limit = self.router.cfg.router.max_prompt_tokens
        if limit and prompt_len > limit:
            self.router.metrics.rejections.labels("prompt_too_long").inc()
            raise ApiError(
                400,
                f"the prompt has {prompt_len} tokens; this server accepts at most {limit}",
                param="prompt",
                code="prompt_too_long",
            )

    async def _deltas(self, req: RouterRequest, text: TextStream) -> AsyncIterator[tuple[str, Any]]:
        """(text delta, finish_reason or None) until the request ends; RequestFailed on error."""
        async for event in self.router.events(req):
            if isinstance(event, ErrorEvent):
                raise RequestFailed(event)
            ids = event.token_ids
            if event.finish_reason == "stop" and ids and ids[-1] in req.stop_ids:
                ids = ids[:-1]  # the stop token's own text is not output (OpenAI semantics)
            delta = text.push(ids, is_last=event.finish_reason is not None)
            if text.stopped:
                self.router.finish_early(req, "stop")
                yield delta, "stop"
                return
            yield delta, event.finish_reason

    async def _sse(self, request: Request, req: RouterRequest, text, fmt, usage: bool):
        watcher = asyncio.create_task(_abort_on_disconnect(request, self.router, req))
        try:
            if fmt.chat:
                yield _sse_event(fmt.chunk({"role": "assistant", "content": ""}, None))
            async for delta, finish in self._deltas(req, text):
                if delta or finish:
                    yield _sse_event(fmt.chunk(delta, finish))
            if usage:
                yield _sse_event(fmt.usage_chunk(req.num_output_tokens))
        except RequestFailed as exc:
            error = ApiError(500, exc.event.message, code=f"failed_at_{exc.event.stage}")
            yield _sse_event(error.body())
        finally:
            watcher.cancel()
            if not req.is_done:
                self.router.abort(req, "client disconnected")
        yield "data: [DONE]\n\n"

    async def _complete(self, request: Request, req: RouterRequest, text, fmt):
        watcher = asyncio.create_task(_abort_on_disconnect(request, self.router, req))
        parts, finish = [], None
        try:
            async for delta, reason in self._deltas(req, text):
                parts.append(delta)
                finish = reason or finish
        except RequestFailed as exc:
            raise ApiError(500, exc.event.message, code=f"failed_at_{exc.event.stage}") from None
        finally:
            watcher.cancel()
            if not req.is_done:
                self.router.abort(req, "client disconnected")
        return fmt.full("".join(parts), finish, req.num_output_tokens)


async def _abort_on_disconnect(request: Request, router: Router, req: RouterRequest) -> None:
    """Waits for the client to go away (the body is already read, so the next ASGI message is
    the disconnect) and aborts the request on both nodes."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            router.abort(req, "client disconnected")
            return


def _sse_event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class _Format:
    """The OpenAI response shapes of one request."""

    request_id: str
    model: str
    chat: bool
    prompt_len: int
    created: int = field(default_factory=lambda: int(time.time()))  # the same in every chunk

    def _base(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
        }

    def usage(self, num_output: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_len,
            "completion_tokens": num_output,
            "total_tokens": self.prompt_len + num_output,
        }

    def chunk(self, delta: str | dict[str, str], finish: str | None) -> dict[str, Any]:
        if self.chat:
            content = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, num_output: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": self.usage(num_output)}

    def full(self, text: str, finish: str | None, num_output: int) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            base = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            base = self._base("text_completion")
        return {**base, "choices": [choice], "usage": self.usage(num_output)}
