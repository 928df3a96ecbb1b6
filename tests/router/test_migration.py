"""Requests outliving their nodes, router core without sockets: a prefill node lost before the
first token is retried unseen; a decode node lost mid-stream has its request re-prefilled
(prompt + streamed tokens) on a surviving pair and the stream goes on with no token repeated or
missing; a failed KV transfer is retried the same way; the number of moves is bounded; messages
of an old attempt are ignored."""

import asyncio
import time

from router_fakes import fake_config, tokens
from test_core import EOS, RecordingTransport, drain, submit  # noqa: F401

from control.protocol import (
    FirstToken,
    NodeFailed,
    NodeReady,
    Prefill,
    RequestError,
    Reserve,
    ReserveReply,
)
from router.core import Router
from router.state import ErrorEvent, RequestState, TokenEvent


def make_router(num_prefill=2, num_decode=2, **router_cfg):
    r = Router(fake_config(num_prefill, num_decode, **router_cfg), [EOS], max_positions=128)
    r.transport = RecordingTransport()
    for node in r.nodes.nodes.values():
        info = {"num_pages": 64, "page_size": 16} if node.role == "decode" else {}
        r.handle(NodeReady(node.name, node.role, info))
    return r


async def answer_reserve(r, count):
    """Runs the loop until `count` Reserves went out, then says yes to the last one."""
    for _ in range(200):
        if len(r.transport.of(Reserve)) >= count:
            break
        await asyncio.sleep(0)
    node, msg = r.transport.of(Reserve)[-1]
    assert len(r.transport.of(Reserve)) == count
    r.handle(ReserveReply(msg.request_id, True, f"tcp://{node}-kv"))
    for _ in range(200):  # until the Prefill of that attempt is out
        if any(m.request_id == msg.request_id for _, m in r.transport.of(Prefill)):
            return node, msg
        await asyncio.sleep(0)
    raise AssertionError("no Prefill followed the reservation")


def tokens_of(events):
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


def test_decode_death_mid_stream_moves_the_request_and_the_stream_goes_on():
    async def main():
        r = make_router()
        req = await submit(r, prompt_len=10, max_new=8)
        first_decode = req.decode_node
        r.handle(FirstToken("r1", 5, 10))
        r.handle(tokens("r1", [6, 7]))
        r.handle(NodeFailed(first_decode, "decode", "killed"))
        assert req.state == RequestState.RESERVING and req.wire_id == "r1~1"
        node, reserve = await answer_reserve(r, 2)
        assert node != first_decode
        assert reserve.request_id == "r1~1" and reserve.prompt_len == 13  # 10 + 3 streamed
        assert reserve.sampling["max_new_tokens"] == 5  # 8 - 3
        ((_, prefill),) = [(n, m) for n, m in r.transport.of(Prefill) if m.request_id == "r1~1"]
        assert prefill.token_ids == list(range(2, 12)) + [5, 6, 7]
        r.handle(tokens("r1", [99]))  # late from the old attempt: ignored
        r.handle(FirstToken("r1~1", 8, 13))
        r.handle(tokens("r1~1", [9, 10, 11, 12], "length"))
        events = drain(req)
        assert tokens_of(events) == [5, 6, 7, 8, 9, 10, 11, 12]
        assert events[-1].finish_reason == "length" and req.state == RequestState.FINISHED
        assert not any(isinstance(e, ErrorEvent) for e in events)
        assert r.metrics.migrations.labels("decode")._value.get() == 1
        assert all(n.num_active == 0 and n.reserved_pages == 0 for n in r.nodes.nodes.values())

    asyncio.run(main())


def test_prefill_death_before_first_token_is_retried_unseen():
    async def main():
        r = make_router()
        req = await submit(r, prompt_len=10, max_new=4)
        lost = req.prefill_node
        r.handle(NodeFailed(lost, "prefill", "killed"))
        _, reserve = await answer_reserve(r, 2)
        assert reserve.prompt_len == 10 and req.prefill_node != lost
        r.handle(FirstToken("r1~1", 5, 10))
        r.handle(tokens("r1~1", [6, 7, 8], "length"))
        events = drain(req)
        assert tokens_of(events) == [5, 6, 7, 8] and events[-1].finish_reason == "length"
        assert r.metrics.migrations.labels("prefill")._value.get() == 1

    asyncio.run(main())


def test_moves_are_bounded_then_the_request_fails_naming_the_stage():
    async def main():
        r = make_router(num_prefill=1, num_decode=3, max_migrations=1)
        req = await submit(r, prompt_len=10, max_new=8)
        r.handle(FirstToken("r1", 5, 10))
        r.handle(NodeFailed(req.decode_node, "decode", "killed"))
        await answer_reserve(r, 2)
        r.handle(FirstToken("r1~1", 6, 11))
        r.handle(NodeFailed(req.decode_node, "decode", "killed again"))
        events = drain(req)
        assert tokens_of(events) == [5, 6]
        assert isinstance(events[-1], ErrorEvent) and events[-1].stage == "decode"
        assert "after 1 migrations" in events[-1].message
        assert req.state == RequestState.FAILED and not r.requests

    asyncio.run(main())


def test_a_move_with_no_pair_left_fails_with_stage_migration():
    async def main():
        r = make_router(num_prefill=1, num_decode=1)
        req = await submit(r, prompt_len=10, max_new=8)
        r.handle(FirstToken("r1", 5, 10))
        started = time.monotonic()
        r.handle(NodeFailed("d0", "decode", "killed"))
        event = await asyncio.wait_for(req.events.get(), 10)  # the token event
        assert event == TokenEvent([5])
        error = await asyncio.wait_for(req.events.get(), 10)
        assert isinstance(error, ErrorEvent) and error.stage == "migration"
        assert "d0" in error.message
        assert time.monotonic() - started >= r.t.reserve_s * 0.9  # it waited for a node
        assert not r.requests and r.nodes.nodes["p0"].num_active == 0

    asyncio.run(main())


def test_a_restarted_decode_node_takes_a_waiting_move():
    async def main():
        r = make_router(num_prefill=1, num_decode=1)
        req = await submit(r, prompt_len=10, max_new=3)
        r.handle(FirstToken("r1", 5, 10))
        r.handle(NodeFailed("d0", "decode", "killed"))
        await asyncio.sleep(0)
        assert len(r.transport.of(Reserve)) == 1  # waiting: no decode node is ready
        r.handle(NodeReady("d0", "decode", {"num_pages": 64, "page_size": 16}))
        await answer_reserve(r, 2)
        r.handle(FirstToken("r1~1", 6, 11))
        r.handle(tokens("r1~1", [7], "length"))
        assert tokens_of(drain(req)) == [5, 6, 7]

    asyncio.run(main())


def test_a_failed_kv_transfer_is_retried_then_bounded():
    """A RequestError of stage "transfer" (the KV link, not the request) is a new attempt, on
    the same single pair here, with the stream going on; the error of the old attempt's other
    node is ignored; past max_migrations the request fails naming the stage and the moves."""

    async def main():
        r = make_router(num_prefill=1, num_decode=1, max_migrations=1)
        req = await submit(r, prompt_len=10, max_new=4)
        r.handle(FirstToken("r1", 5, 10))
        r.handle(RequestError("r1", "transfer", "KV frame failed its integrity check"))
        assert req.state == RequestState.RESERVING and req.wire_id == "r1~1"
        r.handle(RequestError("r1", "transfer", "the peer aborted"))  # the old attempt's: ignored
        assert req.state == RequestState.RESERVING
        _, reserve = await answer_reserve(r, 2)
        assert reserve.prompt_len == 11  # the prompt and the token already streamed
        assert r.metrics.migrations.labels("transfer")._value.get() == 1
        r.handle(FirstToken("r1~1", 6, 11))
        r.handle(RequestError("r1~1", "transfer", "connection dropped"))
        events = drain(req)
        assert tokens_of(events) == [5, 6]
        assert isinstance(events[-1], ErrorEvent) and events[-1].stage == "transfer"
        assert events[-1].message == "connection dropped after 1 migrations"
        assert req.state == RequestState.FAILED and not r.requests

    asyncio.run(main())


def test_other_request_errors_are_not_retried():
    async def main():
        r = make_router(num_prefill=1, num_decode=1)
        req = await submit(r, prompt_len=10, max_new=4)
        r.handle(RequestError("r1", "prefill", "bad request: the prompt is too long"))
        events = drain(req)
        assert events == [ErrorEvent("prefill", "bad request: the prompt is too long")]
        assert r.metrics.migrations.labels("transfer")._value.get() == 0

    asyncio.run(main())
