"""The gateway's front door (a pure ASGI middleware): API key, per-key concurrency, body size.

For each HTTP request, in this order:
  1. key: every path but `/health` (and `/metrics` unless `metrics_need_key`) needs
     `Authorization: Bearer KEY` when keys are configured; else 401 with `WWW-Authenticate`;
  2. concurrency: a completion request takes one of its key's `max_concurrent_per_key` slots
     (429 when none is free); the slot is held for the request's whole life, streaming included,
     and given back on every path (completion, error, client disconnect): just before the last
     body message is sent, or in a `finally` if none is;
  3. body: more than `max_body_bytes`, by Content-Length or by the bytes actually read (chunked
     bodies), is a 413. The body is read here in full, then replayed to the app.
Refusals carry the OpenAI error body and are counted in `duet_rejections_total` by reason.
"""

from __future__ import annotations

from typing import Any

from router.api import ApiError
from router.auth import ANONYMOUS, ApiKeys, KeyLimiter
from router.metrics import RouterMetrics

COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
RETRY_AFTER_S = 1


class _Refused(Exception):
    def __init__(self, error: ApiError, reason: str, headers: dict[str, str] | None = None):
        self.error, self.reason, self.headers = error, reason, headers or {}


class GatewayGuard:
    def __init__(
        self,
        app,
        keys: ApiKeys,
        limiter: KeyLimiter,
        metrics: RouterMetrics,
        max_body_bytes: int,
        metrics_need_key: bool,
    ):
        self.app = app
        self.keys = keys
        self.limiter = limiter
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.open_paths = frozenset({"/health"} if metrics_need_key else {"/health", "/metrics"})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: list[int] = []  # the key id while a concurrency slot is held

        def release() -> None:
            if held:
                self.limiter.release(held.pop())

        async def send_releasing(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release()  # before the client can see the end of the response
            await send(message)

        try:
            key_id = self._key_id(scope)
            if scope["method"] == "POST" and scope["path"] in COMPLETION_PATHS:
                self._take_slot(key_id, held)
            body = await self._read_body(scope, receive)
            if body is None:  # the client left while sending its body
                return
            await self.app(scope, _replay(body, receive), send_releasing)
        except _Refused as refused:
            release()
            self.metrics.rejections.labels(refused.reason).inc()
            response = refused.error.response()
            response.headers.update(refused.headers)
            await response(scope, receive, send)
        finally:
            release()

    # ---- the three checks ------------------------------------------------------------------
    def _key_id(self, scope) -> int:
        if self.keys.is_open or scope["path"] in self.open_paths:
            return ANONYMOUS
        token = _bearer_token(scope)
        key_id = None if token is None else self.keys.match(token)
        if key_id is None:
            message = (
                "missing API key: send 'Authorization: Bearer KEY'"
                if token is None
                else "incorrect API key provided"
            )
            error = ApiError(401, message, code="invalid_api_key")
            raise _Refused(error, "unauthorized", {"WWW-Authenticate": "Bearer"})
        return key_id

    def _take_slot(self, key_id: int, held: list[int]) -> None:
        if not self.limiter.acquire(key_id):
            limit = self.limiter.max_per_key
            message = (
                f"too many concurrent requests for this API key (at most {limit} unfinished "
                "at once); retry when one of them finishes"
            )
            error = ApiError(429, message, code="too_many_requests", retry_after=RETRY_AFTER_S)
            raise _Refused(error, "too_many_per_key")
        held.append(key_id)

    async def _read_body(self, scope, receive) -> bytes | None:
        limit = self.max_body_bytes
        length = _content_length(scope)
        if length is not None and length > limit:
            raise _Refused(_too_large(limit, f"Content-Length is {length}"), "body_too_large")
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _Refused(_too_large(limit, f"more than {limit} bytes sent"), "body_too_large")
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _too_large(limit: int, what: str) -> ApiError:
    message = f"the request body is too large ({what}; the limit is {limit} bytes)"
    return ApiError(413, message, code="body_too_large")


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value
    return None


def _bearer_token(scope) -> bytes | None:
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return None
    return token


def _content_length(scope) -> int | None:
    value = _header(scope, b"content-length")
    if value is None or not value.strip().isdigit() or len(value) > 20:
        return None  # the server rejects malformed values; the bytes read are checked anyway
    return int(value)


def _replay(body: bytes, receive):
    """A `receive` that gives the app the body already read, then the client's next messages
    (the disconnect the app watches for)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict[str, Any]:
        if pending:
            return pending.pop()
        return await receive()

    return replay
