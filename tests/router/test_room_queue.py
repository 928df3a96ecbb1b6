"""Waiting for decode room in turn (`router.room_queue`, `RequestDispatch.reserve_somewhere`):
the queue's order (preempted first, then FIFO) on its own; then through the router core with a
recording transport: with no admission set, a request every decode node refuses for room waits
instead of a 503, a later arrival takes its place behind it without asking the nodes, each asks
again when its turn and room come, a client leaving frees its place, and the wait has a bound,
shows in /metrics and in the request-end record."""

import asyncio

import pytest
from router_fakes import fake_config, tokens
from test_core import RecordingTransport

from control.protocol import FirstToken, NodeReady, Reserve, ReserveReply
from control.sampling_params import SamplingParams
from router.core import Router, RouterError
from router.request_log import request_end_record
from router.room_queue import RoomQueue

EOS = 1


def test_preempted_first_then_arrival_order():
    async def main():
        q = RoomQueue()
        for wire_id, preempted in [("a", False), ("b", False), ("p", True), ("c", False)]:
            q.join(wire_id, preempted)
        assert [q.position(w) for w in "pabc"] == [0, 1, 2, 3]
        q.join("b", True)  # a second join keeps the first place
        assert q.position("b") == 2 and q.position("zz") == -1
        assert q.is_head("p") and len(q) == 4
        assert q.leave("p") >= 0 and q.is_head("a")
        assert q.leave("nobody") == 0.0 and "p" not in q

    asyncio.run(main())


def test_a_waiter_is_told_when_its_turn_comes():
    async def main():
        q = RoomQueue()
        q.join("a", False)
        q.join("b", False)
        waiting = asyncio.create_task(q.wait_turn("b", 30))
        await asyncio.sleep(0)
        assert not waiting.done()
        q.leave("a")
        await asyncio.wait_for(waiting, 5)  # woken by the head leaving, long before 30 s
        assert q.is_head("b")
        q.join("c", False)
        woken = asyncio.create_task(q.wait_turn("c", 30))
        await asyncio.sleep(0)
        q.wake("c")  # an abort makes it look again without being the head
        await asyncio.wait_for(woken, 5)
        assert not q.is_head("c")

    asyncio.run(main())


def make_router(queue_timeout_s):
    cfg = fake_config(sla={"queue_timeout_s": queue_timeout_s})
    r = Router(cfg, [EOS], max_positions=128)
    r.transport = RecordingTransport()
    for node in r.nodes.nodes.values():
        info = {"num_pages": 64, "page_size": 16} if node.role == "decode" else {}
        r.handle(NodeReady(node.name, node.role, info))
    return r


def sample(r, name):
    return r.metrics.registry.get_sample_value(name)


def reserves_of(r, rid):
    return [m for _, m in r.transport.of(Reserve) if m.request_id == rid]


async def until(condition, what):
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def start(r, rid, max_new=3):
    params = SamplingParams(max_new_tokens=max_new)
    return asyncio.create_task(r.submit(rid, [2, 3, 4], params))


def answer(r, rid, ok):
    (node, msg) = [(n, m) for n, m in r.transport.of(Reserve) if m.request_id == rid][-1]
    r.handle(ReserveReply(msg.request_id, ok, f"tcp://{node}-kv", reason="no free pages"))


def test_requests_wait_for_room_in_turn_then_run():
    async def main():
        r = make_router(queue_timeout_s=60)
        running = start(r, "r0")
        await until(lambda: reserves_of(r, "r0"), "r0 asks")
        answer(r, "r0", True)
        req0 = await running
        r.handle(FirstToken("r0", 10, 3))
        # the pool is full now: r1 is refused, and waits at the head of the queue
        first = start(r, "r1")
        await until(lambda: reserves_of(r, "r1"), "r1 asks")
        answer(r, "r1", False)
        await until(lambda: r.dispatch.room_queue.is_head("r1"), "r1 waits in turn")
        # r2 arrives while r1 waits: it queues behind r1 without asking any node
        second = start(r, "r2")
        await until(lambda: "r2" in r.dispatch.room_queue, "r2 waits in turn")
        assert r.dispatch.room_queue.position("r2") == 1 and not reserves_of(r, "r2")
        assert sample(r, "duet_router_waiting_for_room") == 2
        # r0 ends: its room comes back, r1 asks again and gets it; then r2's turn
        r.handle(tokens("r0", [11, 12], "length"))
        await until(lambda: len(reserves_of(r, "r1")) == 2, "r1 asks again")
        assert not reserves_of(r, "r2")  # not before r1 has its room
        answer(r, "r1", True)
        req1 = await first
        await until(lambda: reserves_of(r, "r2"), "r2 asks on its turn")
        answer(r, "r2", True)
        req2 = await second
        assert len(r.dispatch.room_queue) == 0 and req0.room_wait_s == 0
        assert req1.room_wait_s > 0 and req2.room_wait_s > 0
        assert request_end_record(req2, "finished")["room_wait_s"] == pytest.approx(
            req2.room_wait_s, abs=1e-6
        )
        assert r.metrics.room_wait._sum.get() == pytest.approx(req1.room_wait_s + req2.room_wait_s)

    asyncio.run(main())


def test_a_client_leaving_gives_its_place_to_the_next():
    async def main():
        r = make_router(queue_timeout_s=60)
        first = start(r, "r1")
        await until(lambda: reserves_of(r, "r1"), "r1 asks")
        answer(r, "r1", False)
        await until(lambda: "r1" in r.dispatch.room_queue, "r1 waits")
        second = start(r, "r2")
        await until(lambda: "r2" in r.dispatch.room_queue, "r2 waits")
        first.cancel()  # the HTTP task went away
        with pytest.raises(asyncio.CancelledError):
            await first
        await until(lambda: reserves_of(r, "r2"), "r2 asks once r1 left")
        answer(r, "r2", True)
        await second
        assert "r1" not in r.requests and len(r.dispatch.room_queue) == 0

    asyncio.run(main())


def test_the_wait_is_bounded_then_503():
    async def main():
        r = make_router(queue_timeout_s=0.3)
        task = start(r, "r1")
        await until(lambda: reserves_of(r, "r1"), "r1 asks")
        answer(r, "r1", False)
        with pytest.raises(RouterError) as err:
            await task  # every later ask goes unanswered: the deadline ends it
        assert err.value.status == 503
        assert len(r.dispatch.room_queue) == 0 and "r1" not in r.requests

    asyncio.run(main())


def test_with_no_wait_configured_a_refusal_is_503_at_once():
    async def main():
        r = make_router(queue_timeout_s=0)
        task = start(r, "r1")
        await until(lambda: reserves_of(r, "r1"), "r1 asks")
        answer(r, "r1", False)
        with pytest.raises(RouterError) as err:
            await task
        assert err.value.code == "no_decode_room" and "no free pages" in err.value.message
        assert len(reserves_of(r, "r1")) == 1

    asyncio.run(main())


@pytest.mark.parametrize("queue_timeout_s", [30, 0])
def test_a_burst_past_the_pool_is_served_in_turn_over_http(model_dir, tok, queue_timeout_s):
    """Eight requests at once on a decode pool with room for one at a time (4 pages of 16
    tokens; each needs 3): with the wait they all complete, in arrival order of their room;
    without it (queue_timeout_s = 0) the ones that find no room get 503."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from router_fakes import start_cluster, stop_all

    cfg = fake_config(sla={"queue_timeout_s": queue_timeout_s})
    small = tuple(dataclasses.replace(d, num_pages=4) for d in cfg.decode)
    cfg = dataclasses.replace(cfg, decode=small)
    started = []
    try:
        fakes, server = start_cluster(
            cfg, tok.encode("one two three four five six"), tok.eos_token_ids[0], model_dir, started
        )

        def post(i):
            body = {"prompt": f"request {i}", "max_tokens": 30, "ignore_eos": True}
            return httpx.post(server.url + "/v1/completions", json=body, timeout=60)

        with ThreadPoolExecutor(8) as pool:
            statuses = [r.status_code for r in pool.map(post, range(8))]
        if queue_timeout_s:
            assert statuses == [200] * 8
            text = httpx.get(server.url + "/metrics", timeout=10).text
            waited = [line for line in text.splitlines() if "room_wait_seconds_count" in line]
            assert waited and float(waited[0].split()[-1]) >= 1  # some waited for room
        else:
            assert 200 in statuses and 503 in statuses
        assert fakes.used_pages("d0") == 0
    finally:
        stop_all(started)
