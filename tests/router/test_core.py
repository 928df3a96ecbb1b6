"""Router core without sockets: a recording transport, node messages fed through `handle`.

Covers the request state machine (forward only, sticky FAILED), pairing by load, token
ordering when D's tokens beat P's first token, the router's own stop checks, aborts reaching
both nodes, node death, and every stage deadline."""

import asyncio
import time

import pytest
from router_fakes import fake_config, tokens

from control.protocol import (
    Abort,
    FirstToken,
    Heartbeat,
    NodeFailed,
    NodeReady,
    Prefill,
    RequestError,
    Reserve,
    ReserveReply,
)
from control.sampling_params import SamplingParams
from router.core import Router, RouterError
from router.nodes import NodeState
from router.policy import LeastLoadedPolicy
from router.state import ErrorEvent, RequestState, RouterRequest, TokenEvent

EOS = 1


class RecordingTransport:
    def __init__(self):
        self.sent: list[tuple[str, object]] = []

    def send(self, node, msg):
        self.sent.append((node, msg))
        return True

    def of(self, kind):
        return [(n, m) for n, m in self.sent if isinstance(m, kind)]

    def lost_connections(self):
        return []


def make_router(num_prefill=1, num_decode=1, **router_cfg):
    r = Router(fake_config(num_prefill, num_decode, **router_cfg), [EOS], max_positions=128)
    r.transport = RecordingTransport()
    for node in r.nodes.nodes.values():
        info = {"num_pages": 64, "page_size": 16} if node.role == "decode" else {}
        r.handle(NodeReady(node.name, node.role, info))
    return r


async def submit(r, rid="r1", prompt_len=10, max_new=5, reply=True, **sp):
    """Submits and answers the Reserve (ok) like a decode node would."""
    task = asyncio.create_task(
        r.submit(rid, list(range(2, 2 + prompt_len)), SamplingParams(max_new_tokens=max_new, **sp))
    )
    await sent_reserves(r, len(r.transport.of(Reserve)) + 1, task)
    if reply and not task.done():
        node, msg = r.transport.of(Reserve)[-1]
        r.handle(ReserveReply(msg.request_id, True, f"tcp://{node}-kv"))
    return await task


async def sent_reserves(r, count, task=None):
    """Lets the submit task run until it has sent `count` Reserve messages (or ended)."""
    for _ in range(100):
        if len(r.transport.of(Reserve)) >= count or (task is not None and task.done()):
            return
        await asyncio.sleep(0)
    raise AssertionError(f"fewer than {count} Reserve messages were sent")


def drain(req: RouterRequest):
    out = []
    while not req.events.empty():
        out.append(req.events.get_nowait())
    return out


def test_state_machine_only_moves_forward_and_failed_is_sticky():
    req = RouterRequest("x", 1, [2, 3], SamplingParams(), frozenset())
    assert req.advance(RequestState.PREFILLING)
    assert not req.advance(RequestState.RESERVING)  # backwards: refused
    assert not req.advance(RequestState.PREFILLING)  # same: refused
    assert req.advance(RequestState.FAILED)
    assert not req.advance(RequestState.FINISHED)  # sticky
    assert req.state == RequestState.FAILED


def test_policy_prefers_fewest_queued_tokens_and_most_free_pages():
    p = [NodeState("a", "prefill", "", 16, 0), NodeState("b", "prefill", "", 16, 0)]
    p[0].queued_tokens = 100
    assert LeastLoadedPolicy().pick_prefill(p, [2] * 10).name == "b"
    d = [NodeState("x", "decode", "", 16, 10), NodeState("y", "decode", "", 16, 20)]
    assert [n.name for n in LeastLoadedPolicy().rank_decode(d, 16)] == ["y", "x"]
    assert [n.name for n in LeastLoadedPolicy().rank_decode(d, 16 * 15)] == ["y"]  # x can't fit
    assert LeastLoadedPolicy().rank_decode(d, 16 * 21) == []


def test_happy_path_orders_tokens_and_finishes():
    async def main():
        r = make_router()
        req = await submit(r, max_new=4)
        assert req.state == RequestState.PREFILLING
        ((_, pre),) = r.transport.of(Prefill)
        assert pre.kv_endpoint == "tcp://d0-kv" and pre.room == req.room
        # D's first tokens arrive before P's FirstToken: they wait and come out in order
        r.handle(tokens("r1", [11, 12]))
        assert drain(req) == []
        r.handle(FirstToken("r1", 10, 10))
        r.handle(tokens("r1", [13], "length"))
        events = drain(req)
        assert events == [TokenEvent([10, 11, 12], None), TokenEvent([13], "length")]
        assert req.state == RequestState.FINISHED and "r1" not in r.requests
        assert r.nodes.nodes["d0"].reserved_pages == 0 and r.nodes.nodes["p0"].queued_tokens == 0
        r.handle(tokens("r1", [14]))  # late: ignored
        assert drain(req) == []

    asyncio.run(main())


@pytest.mark.parametrize("first,max_new,reason", [(EOS, 5, "stop"), (7, 1, "length")])
def test_router_ends_request_at_first_token_and_aborts_decode(first, max_new, reason):
    async def main():
        r = make_router()
        req = await submit(r, max_new=max_new)
        r.handle(FirstToken("r1", first, 10))
        assert drain(req) == [TokenEvent([first], reason)]
        assert ("d0", Abort("r1", "finished")) in r.transport.sent

    asyncio.run(main())


def test_router_stops_on_stop_token_id_even_if_decode_does_not():
    async def main():
        r = make_router()
        req = await submit(r, max_new=10, stop_token_ids=(42,))
        r.handle(FirstToken("r1", 5, 10))
        r.handle(tokens("r1", [6, 42, 43]))
        assert drain(req)[-1] == TokenEvent([6, 42], "stop")
        assert req.num_output_tokens == 3

    asyncio.run(main())


def test_pairing_spreads_a_burst_over_prefill_nodes():
    async def main():
        # One prompt six times: no prefix affinity may outweigh a queue (balance 0).
        r = make_router(num_prefill=2, num_decode=2, cache_balance_tokens=0)
        for i in range(6):
            await submit(r, f"r{i}", prompt_len=20)
        prefill_nodes = [n for n, _ in r.transport.of(Prefill)]
        decode_nodes = [n for n, _ in r.transport.of(Reserve)]
        assert prefill_nodes.count("p0") == 3 and prefill_nodes.count("p1") == 3
        assert decode_nodes.count("d0") == 3 and decode_nodes.count("d1") == 3

    asyncio.run(main())


def test_refusal_tries_next_decode_node_then_503():
    async def main():
        r = make_router(num_decode=2)
        task = asyncio.create_task(r.submit("r1", [2, 3], SamplingParams(max_new_tokens=2)))
        await sent_reserves(r, 1)
        r.handle(ReserveReply("r1", False, reason="no free pages"))
        await sent_reserves(r, 2)
        r.handle(ReserveReply("r1", False, reason="too many requests"))
        with pytest.raises(RouterError) as err:
            await task
        assert err.value.status == 503 and err.value.retry_after
        assert "no free pages" in err.value.message and "too many requests" in err.value.message
        assert len(r.transport.of(Reserve)) == 2 and not r.transport.of(Prefill)
        assert not r.requests and all(n.reserved_pages == 0 for n in r.nodes.of_role("decode"))

    asyncio.run(main())


def test_reserve_timeout_names_the_stage_and_aborts():
    async def main():
        r = make_router()
        with pytest.raises(RouterError) as err:
            await submit(r, reply=False)
        assert "stage reserve" in err.value.message
        assert ("d0", Abort("r1", "reserve timed out")) in r.transport.sent
        assert not r.requests

    asyncio.run(main())


def test_overload_and_no_room_are_503():
    async def main():
        r = make_router(max_queued_requests=1)
        await submit(r)
        with pytest.raises(RouterError) as err:
            await submit(r, "r2")
        assert err.value.status == 503 and "too many" in err.value.message
        r2 = make_router()
        r2.max_positions = 4096
        with pytest.raises(RouterError) as err:  # 64 pages of 16 tokens: 2000 tokens don't fit
            await submit(r2, prompt_len=100, max_new=1900, reply=False)
        assert err.value.code == "no_decode_room"

    asyncio.run(main())


def test_node_error_and_abort_reach_both_nodes():
    async def main():
        r = make_router()
        req = await submit(r)
        r.handle(RequestError("r1", "prefill", "prefill forward failed"))
        assert drain(req) == [ErrorEvent("prefill", "prefill forward failed")]
        aborted = {n for n, m in r.transport.of(Abort) if m.request_id == "r1"}
        assert aborted == {"p0", "d0"}
        req2 = await submit(r, "r2")
        r.abort(req2)
        r.abort(req2)  # twice: no-op
        assert sum(1 for _, m in r.transport.of(Abort) if m.request_id == "r2") == 2
        assert req2.state == RequestState.FAILED

    asyncio.run(main())


@pytest.mark.parametrize("how", ["silent", "failed"])
def test_dead_decode_node_fails_its_requests(how):
    """With migrations off (and no other pair in any case), a dead node's requests fail."""

    async def main():
        r = make_router(max_migrations=0)
        req = await submit(r)
        r.handle(FirstToken("r1", 5, 10))
        if how == "failed":
            r.handle(NodeFailed("d0", "decode", "out of memory"))
        else:
            r.check_deadlines(time.monotonic() + r.t.node_timeout_s + 1)
        *_, last = drain(req)
        assert isinstance(last, ErrorEvent) and last.stage == "decode" and "d0" in last.message
        assert not r.is_serving
        r.handle(Heartbeat("d0", "decode", free_pages=64, total_pages=64, page_size=16))
        r.handle(Heartbeat("p0", "prefill"))
        assert r.is_serving  # back

    asyncio.run(main())


def test_stage_deadlines():
    async def main():
        r = make_router()
        slow_prefill = await submit(r, "a")
        slow_decode = await submit(r, "b")
        r.handle(FirstToken("b", 5, 10))
        now = time.monotonic()
        for node in r.nodes.nodes.values():  # keep the nodes alive
            node.last_seen = now + 10_000
        r.check_deadlines(now + r.t.prefill_queue_s + r.t.transfer_s + 1)
        assert drain(slow_prefill)[-1].stage == "prefill_queue"
        assert slow_decode.state == RequestState.DECODING
        r.check_deadlines(now + r.t.decode_s + 1)
        assert drain(slow_decode)[-1].stage == "decode"

    asyncio.run(main())


def test_incompatible_node_is_refused_at_ready():
    r = Router(fake_config(), [EOS], 128, fingerprint={"num_hidden_layers": 3})
    r.transport = RecordingTransport()
    r.handle(NodeReady("p0", "prefill", {"fingerprint": {"model.num_hidden_layers": 3, "x": 1}}))
    assert r.nodes.nodes["p0"].is_ready  # kvtransfer's form, extra fields: compatible
    r.handle(NodeReady("d0", "decode", {"fingerprint": {"num_hidden_layers": 4}}))
    r.handle(Heartbeat("d0", "decode", free_pages=1, total_pages=1))
    assert r.nodes.nodes["d0"].status == "dead" and "incompatible" in r.nodes.nodes["d0"].error


def test_cancelled_submit_leaves_nothing_behind():
    async def main():
        r = make_router()
        task = asyncio.create_task(r.submit("r1", [2, 3], SamplingParams(max_new_tokens=2)))
        await sent_reserves(r, 1, task)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not r.requests and r.nodes.nodes["d0"].reserved_pages == 0
        assert ("d0", Abort("r1", "cancelled during reservation")) in r.transport.sent

    asyncio.run(main())
