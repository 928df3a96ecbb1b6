"""The OpenAI-compatible HTTP gateway (FastAPI) over a `Router`: completions (one prompt or a
batch) and chat completions (SSE streaming or one JSON body, `router.serving`), vLLM's
`/tokenize` and `/detokenize`, models, health and Prometheus metrics.

Every accepted request ends with a completion or an error: a failure mid-stream is sent as a
`data: {"error": ...}` event (the openai client raises it); a client that disconnects has its
requests aborted on both nodes at once. API keys, per-key concurrency and the body size are
checked in front of every route (`router.guard`); client input never gets a 5xx: a 5xx means
the server failed (503 no node or overload, 500 a node failing mid-request). Unknown top-level
fields are ignored and named in the `x-duet-ignored-fields` header (`router.unknown_fields`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from control.tokenizer import Tokenizer
from router.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    parse_body,
    parse_tokenize_body,
)
from router.auth import ApiKeys, KeyLimiter
from router.cluster_view import cluster_view
from router.core import Router
from router.guard import GatewayGuard
from router.kv_index import kv_index_summary
from router.metrics import CONTENT_TYPE
from router.responses_api import ResponsesRequest, respond
from router.serving import ModelInfo, Prompts, Serving
from router.unknown_fields import ignored_fields_headers

log = logging.getLogger("router")

__all__ = ["ModelInfo", "create_app"]


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
    serving = Serving(router, tokenizer, model)

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

    @app.get("/v1/cluster")
    async def cluster():
        return cluster_view(router.cfg, router.nodes, router.is_serving, replica=router.replica)

    @app.get("/v1/kv_index/summary")
    async def kv_index():
        return kv_index_summary(router.kv_index, list(router.nodes.nodes.values()))

    def card() -> dict:
        return {
            "id": model.name,
            "object": "model",
            "created": 0,
            "owned_by": "duet-serve",
            "max_model_len": model.max_positions,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str):
        if model_id not in (model.name, model.path):
            raise ApiError(
                404,
                f"the model '{model_id}' does not exist (this server has '{model.name}')",
                param="model",
                code="model_not_found",
            )
        return card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, ignored = parse_body(await request.body(), CompletionRequest)
        return await _noting(
            ignored, lambda: serving.run(request, body, serving.completion_prompts(body))
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, ignored = parse_body(await request.body(), ChatCompletionRequest)

        def run():
            args = (body.messages, body.add_generation_prompt, body.add_special_tokens)
            ids = serving.chat_prompt(
                *args,
                body.chat_template_kwargs,
                body.tools,
                continue_final_message=body.continue_final_message,
            )
            return serving.run(request, body, Prompts([ids]))

        return await _noting(ignored, run)

    @app.post("/v1/responses")
    async def responses(request: Request):
        body, ignored = parse_body(await request.body(), ResponsesRequest)

        async def run():
            out = await respond(serving, request, body)
            if body.stream:
                return StreamingResponse(out, media_type="text/event-stream")
            return JSONResponse(out)

        return await _noting(ignored, run)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body, ignored = parse_tokenize_body(await request.body())

        async def run():
            serving.check_model(body.model)
            if isinstance(body, TokenizeChatRequest):
                args = (body.messages, body.add_generation_prompt, body.add_special_tokens)
                ids = serving.chat_prompt(
                    *args,
                    body.chat_template_kwargs,
                    body.tools,
                    continue_final_message=body.continue_final_message,
                )
            else:
                ids = serving.encode_text(body.prompt, body.add_special_tokens)
            strs = [tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
            out = {"count": len(ids), "max_model_len": model.max_positions, "tokens": ids}
            return JSONResponse({**out, "token_strs": strs})

        return await _noting(ignored, run)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body, ignored = parse_body(await request.body(), DetokenizeRequest)

        async def run():
            serving.check_model(body.model)
            for i, token in enumerate(body.tokens):
                if not 0 <= token < model.vocab_size:
                    raise ApiError(
                        400,
                        f"tokens[{i}]: token id {token} is outside the vocabulary "
                        f"[0, {model.vocab_size})",
                        param="tokens",
                        code="invalid_value",
                    )
            # As vLLM: special tokens are kept, so detokenize(tokenize(text)) shows the bos.
            text = tokenizer.decode(body.tokens, skip_special_tokens=False)
            return JSONResponse({"prompt": text})

        return await _noting(ignored, run)

    return app


async def _noting(ignored: list[str], handler: Callable[[], Awaitable[Response]]) -> Response:
    """`await handler()` with the ignored fields' header on its response, error or not."""
    headers = ignored_fields_headers(ignored)
    try:
        response = await handler()
    except ApiError as exc:
        exc.headers.update(headers)
        raise
    response.headers.update(headers)
    return response
