"""A fake OpenAI-compatible streaming server for bench-serve tests (no model).

It streams `max_tokens` chunks of one word token each, sleeping `ttft_s` before the first and
`itl_s` between the others, so the latencies a client measures have known lower bounds. Request k
(in arrival order, from 0) can fail with HTTP 503 (`http_error_every`) or with an error event in
the middle of its stream (`stream_error_every`). It records every body it receives and the most
requests it had in flight at once.

Run as a script (`python bench_fakes.py --config FILE [--model DIR]`) it stands in for
`duet up`: it serves on the config's router address until SIGINT, and /health answers 503 for
its first `READY_AFTER_S` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

WORD = " the"  # one token in the tiny model's tokenizer
READY_AFTER_S = 0.5


@dataclass
class FakeBehavior:
    ttft_s: float = 0.05
    itl_s: float = 0.01
    http_error_every: int = 0
    stream_error_every: int = 0
    usage: bool = True  # honour stream_options.include_usage
    ready_after_s: float = 0.0


@dataclass
class FakeState:
    received: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_app(behavior: FakeBehavior) -> tuple[FastAPI, FakeState]:
    app = FastAPI()
    state = FakeState()
    started = time.monotonic()

    @app.get("/health")
    async def health():
        ready = time.monotonic() - started >= behavior.ready_after_s
        return JSONResponse({"status": "ok" if ready else "starting"}, 200 if ready else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def serve(request: Request, chat: bool):
        body = await request.json()
        k = len(state.received)
        state.received.append(body)
        if (
            behavior.http_error_every
            and k % behavior.http_error_every == behavior.http_error_every - 1
        ):
            err = {"message": "overloaded", "type": "service_unavailable_error", "code": "busy"}
            return JSONResponse({"error": err}, status_code=503)
        fail_mid = bool(behavior.stream_error_every) and (
            k % behavior.stream_error_every == behavior.stream_error_every - 1
        )
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        n_out = body["max_tokens"]
        usage = behavior.usage and (body.get("stream_options") or {}).get("include_usage")

        def chunk(text: str, finish=None):
            if chat:
                return {
                    "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]
                }
            return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}

        async def stream():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if chat:  # the role chunk carries no text: it must not count as the first token
                    yield _sse(
                        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                    )
                await asyncio.sleep(behavior.ttft_s)
                for i in range(n_out):
                    if i:
                        await asyncio.sleep(behavior.itl_s)
                    if fail_mid and i == 2:
                        yield _sse({"error": {"message": "node died", "code": "failed_at_decode"}})
                        break
                    yield _sse(chunk(WORD))
                else:
                    yield _sse(chunk("", "length"))
                    if usage:
                        n_in = len(prompt.split())
                        u = {"prompt_tokens": n_in, "completion_tokens": n_out,
                             "total_tokens": n_in + n_out}  # fmt: skip
                        yield _sse({"choices": [], "usage": u})
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app, state


class ServerThread:
    """uvicorn serving an app on a free loopback port in a daemon thread."""

    def __init__(self, app: FastAPI):
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10.0
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10.0)


def main() -> None:
    import os

    from control.cluster_config import ClusterConfig

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--model")
    args = p.parse_args()
    cfg = ClusterConfig.load(args.config)
    print(f"fake cluster pid {os.getpid()} model {args.model}", flush=True)
    app, _ = make_app(FakeBehavior(ttft_s=0.02, itl_s=0.005, ready_after_s=READY_AFTER_S))
    uvicorn.run(app, host=cfg.router.host, port=cfg.router.port, log_level="warning")


if __name__ == "__main__":
    main()
