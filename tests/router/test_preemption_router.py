"""Router core without sockets, on-demand decode KV: a request its decode node
preempted is re-prefilled (prompt + streamed tokens) and its stream goes on with no token
repeated or missing; a Preempted that beats P's first token waits for it; a preempted request
waits for room instead of failing; preemptions have their own bound (not max_migrations) and
one past it fails naming the reason; reservations are estimated by the node's rule."""

import asyncio
import dataclasses

from router_fakes import fake_config, tokens
from test_core import EOS, RecordingTransport, drain, submit  # noqa: F401
from test_migration import answer_reserve, tokens_of

from control.protocol import (
    FirstToken,
    NodeFailed,
    NodeReady,
    Preempted,
    Prefill,
    Reserve,
    ReserveReply,
)
from router.core import Router
from router.state import ErrorEvent, RequestState, TokenEvent

REASON = "the KV pool (64 pages) ran out: request x needed a page for position 80"


def make_router(num_prefill=1, num_decode=1, info=None, decode_s=None, **router_cfg):
    cfg = fake_config(num_prefill, num_decode, **router_cfg)
    if decode_s is not None:
        cfg = dataclasses.replace(
            cfg, timeouts=dataclasses.replace(cfg.timeouts, decode_s=decode_s)
        )
    r = Router(cfg, [EOS], max_positions=128)
    r.transport = RecordingTransport()
    for node in r.nodes.nodes.values():
        extra = info or {}
        ready = {"num_pages": 64, "page_size": 16, **extra} if node.role == "decode" else {}
        r.handle(NodeReady(node.name, node.role, ready))
    return r


async def reserves_sent(r, count, timeout_s=10.0):
    """Until the router has sent `count` Reserves (bounded)."""

    async def wait():
        while len(r.transport.of(Reserve)) < count:
            await asyncio.sleep(0.001)

    await asyncio.wait_for(wait(), timeout_s)


def counter(metric, *labels):
    return (metric.labels(*labels) if labels else metric)._value.get()


def test_a_preempted_request_is_re_prefilled_and_its_stream_goes_on():
    async def main():
        r = make_router(num_decode=2)
        req = await submit(r, prompt_len=10, max_new=100)
        assert req.reserved_pages == 3  # on_demand: 10 + 32 headroom tokens, not 10 + 100
        first_decode = req.decode_node
        r.handle(FirstToken("r1", 5, 10))
        r.handle(tokens("r1", [6]))
        r.handle(tokens("r1", [7]))
        r.handle(Preempted("r1", 3, REASON))
        assert req.state == RequestState.RESERVING and req.wire_id == "r1~1"
        assert req.num_preemptions == 1 and req.num_migrations == 0
        node, reserve = await answer_reserve(r, 2)
        assert reserve.prompt_len == 13 and reserve.sampling["max_new_tokens"] == 97
        assert req.reserved_pages == 3  # 13 + 32 tokens
        ((_, prefill),) = [(n, m) for n, m in r.transport.of(Prefill) if m.request_id == "r1~1"]
        assert prefill.token_ids == list(range(2, 12)) + [5, 6, 7]
        r.handle(tokens("r1", [99]))  # late from the preempted attempt: ignored
        r.handle(FirstToken("r1~1", 8, 13))
        r.handle(tokens("r1~1", [9, EOS], "stop"))
        events = drain(req)
        assert tokens_of(events) == [5, 6, 7, 8, 9, EOS] and events[-1].finish_reason == "stop"
        assert not any(isinstance(e, ErrorEvent) for e in events)
        assert counter(r.metrics.preemptions) == 1
        assert counter(r.metrics.migrations, "decode") == 0
        assert all(n.num_active == 0 and n.reserved_pages == 0 for n in r.nodes.nodes.values())
        assert first_decode in r.nodes.nodes and not r.requests

    asyncio.run(main())


def test_worst_case_nodes_are_estimated_on_worst_case_terms():
    async def main():
        r = make_router(info={"kv_reservation": "worst_case", "kv_headroom_tokens": 0})
        req = await submit(r, prompt_len=10, max_new=100)
        assert req.reserved_pages == 7  # 110 tokens
        r.handle(FirstToken("r1", 5, 10))
        r.handle(tokens("r1", [6, 7, 8, 9, 10]))
        r.handle(Preempted("r1", 6, REASON))
        await answer_reserve(r, 2)
        assert req.reserved_pages == 7  # 15 + 95 tokens

    asyncio.run(main())


def test_a_preempted_that_beats_the_first_token_waits_for_it():
    async def main():
        r = make_router()
        req = await submit(r, prompt_len=10, max_new=8)
        r.handle(tokens("r1", [6]))  # D's token before P's FirstToken (another socket)
        r.handle(Preempted("r1", 2, REASON))
        assert req.state == RequestState.PREFILLING and req.attempt == 0
        r.handle(FirstToken("r1", 5, 10))
        assert drain(req) == [TokenEvent([5, 6])]
        assert req.state == RequestState.RESERVING and req.attempt_prompt_ids[-2:] == [5, 6]
        _, reserve = await answer_reserve(r, 2)
        assert reserve.prompt_len == 12 and reserve.sampling["max_new_tokens"] == 6

    asyncio.run(main())


def test_preemptions_do_not_use_up_migrations():
    async def main():
        r = make_router(num_decode=2, max_migrations=0, max_preemptions=3)
        req = await submit(r, prompt_len=10, max_new=8)
        r.handle(FirstToken("r1", 5, 10))
        for attempt in (1, 2):
            r.handle(Preempted(req.wire_id, 1, REASON))
            await answer_reserve(r, attempt + 1)
            r.handle(FirstToken(req.wire_id, 5 + attempt, 10 + attempt))
        assert req.state == RequestState.DECODING and req.num_migrations == 0
        r.handle(NodeFailed(req.decode_node, "decode", "killed"))  # no migration allowed
        events = drain(req)
        assert tokens_of(events) == [5, 6, 7]
        assert isinstance(events[-1], ErrorEvent) and events[-1].stage == "decode"
        assert "migrations" not in events[-1].message

    asyncio.run(main())


def test_a_request_preempted_too_often_fails_naming_the_reason():
    async def main():
        r = make_router(max_preemptions=1)
        req = await submit(r, prompt_len=10, max_new=8)
        r.handle(FirstToken("r1", 5, 10))
        r.handle(Preempted("r1", 1, REASON))
        await answer_reserve(r, 2)
        r.handle(FirstToken("r1~1", 6, 11))
        r.handle(tokens("r1~1", [7]))
        r.handle(Preempted("r1~1", 2, REASON))
        events = drain(req)
        assert tokens_of(events) == [5, 6, 7]
        error = events[-1]
        assert isinstance(error, ErrorEvent) and error.stage == "preemption"
        assert "preempted 2 times" in error.message and "max_preemptions is 1" in error.message
        assert REASON in error.message
        assert req.state == RequestState.FAILED and not r.requests
        assert counter(r.metrics.failures, "preemption") == 1
        assert counter(r.metrics.preemptions) == 2
        assert all(n.num_active == 0 and n.reserved_pages == 0 for n in r.nodes.nodes.values())

    asyncio.run(main())


def test_a_preempted_request_waits_for_room_then_goes_on():
    async def main():
        r = make_router()
        req = await submit(r, prompt_len=10, max_new=8)
        r.handle(FirstToken("r1", 5, 10))
        r.handle(Preempted("r1", 1, REASON))
        for count in (2, 3):  # the node refuses twice: no room yet
            await reserves_sent(r, count)
            _, msg = r.transport.of(Reserve)[-1]
            r.handle(ReserveReply(msg.request_id, False, reason="no room: needs 2 KV pages"))
            assert not req.is_done
        await reserves_sent(r, 4)  # asked again (a heartbeat interval later at most)
        await answer_reserve(r, 4)
        r.handle(FirstToken("r1~1", 6, 11))
        r.handle(tokens("r1~1", [EOS], "stop"))
        events = drain(req)
        assert tokens_of(events) == [5, 6, EOS] and events[-1].finish_reason == "stop"

    asyncio.run(main())


def test_a_preempted_request_that_never_finds_room_fails_in_bounded_time():
    async def main():
        r = make_router(decode_s=1.0)  # the wait for room is bounded by the decode budget
        req = await submit(r, prompt_len=10, max_new=8)
        r.handle(FirstToken("r1", 5, 10))
        r.handle(Preempted("r1", 1, REASON))

        async def refuse_everything():
            answered = 1
            while True:
                reserves = r.transport.of(Reserve)
                for _, msg in reserves[answered:]:
                    r.handle(ReserveReply(msg.request_id, False, reason="no room"))
                answered = len(reserves)
                await asyncio.sleep(0.005)

        refuser = asyncio.create_task(refuse_everything())
        try:
            assert await asyncio.wait_for(req.events.get(), 5) == TokenEvent([5])
            error = await asyncio.wait_for(req.events.get(), 10)
        finally:
            refuser.cancel()
        assert isinstance(error, ErrorEvent) and error.stage == "preemption"
        assert "no decode node had room for it again" in error.message
        assert counter(r.metrics.failures, "preemption") == 1 and not r.requests

    asyncio.run(main())
