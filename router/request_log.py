"""Request ids and the router's structured request log.

The request id is the response body's `id` (`cmpl-...` / `chatcmpl-...`) and is sent back in
the `x-request-id` response header. A client may choose it, as with vLLM, by sending its own
`x-request-id`: the id becomes `cmpl-<its value>` (1 to 128 characters of `A-Z a-z 0-9 . _ : -`,
else a 400; `router.serving.request_id_for`). vLLM echoes the client's header verbatim; here the
header always equals the body's `id`, and a client id still in use by an unfinished request is a
400. A prompt of a batch is the router request `<id>-<index>`; the nodes know a request by its
wire id, which is the request id (`<id>~<n>` after `n` moves to another node pair), so one grep
for the id finds its lines in every role's log.

Each router request that ends (finished, failed, aborted, or rejected after admission began)
logs one JSON line on the logger "router.requests": its id, outcome, finish reason or the stage
it failed at, token counts, TTFT / TPOT / end-to-end seconds, and its prefill and decode node.
`configure()` makes those lines bare JSON (no timestamp prefix) on stderr.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from router.state import RouterRequest

log = logging.getLogger("router.requests")


def request_end_record(req: RouterRequest, outcome: str) -> dict[str, Any]:
    """The log record of a request that ended with `outcome` (finished, failed, aborted,
    rejected). Seconds; None for a moment that never came (no first token, fewer than 2
    tokens for TPOT)."""
    t = req.timings
    end = t.finished or time.monotonic()
    failed = outcome != "finished" and req.error is not None
    return {
        "event": "request_end",
        "request_id": req.request_id,
        "outcome": outcome,
        "finish_reason": req.finish_reason,
        "stage": req.error.stage if failed else None,
        "error": req.error.message if failed else None,
        "prompt_tokens": req.prompt_len,
        "completion_tokens": req.num_output_tokens,
        "ttft_s": _seconds(t.ttft) if t.first_token else None,
        "tpot_s": _seconds(t.tpot(req.num_output_tokens)) if t.first_token else None,
        "e2e_s": _seconds(end - t.arrival),
        "prefill_node": req.prefill_node,
        "decode_node": req.decode_node,
        "migrations": req.num_migrations,
        "preemptions": req.num_preemptions,  # on-demand decode KV
        "room_wait_s": _seconds(req.room_wait_s),  # waiting for decode room, in turn
    }


def log_request_end(req: RouterRequest, outcome: str) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info(json.dumps(request_end_record(req, outcome), ensure_ascii=False))


def configure(stream=None) -> None:
    """Request lines as bare JSON lines on `stream` (default stderr), not through the root
    logger's text format."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
