"""Router core without sockets, n > 1: one Reserve and one Prefill for all sequences (the forks'
wire ids in the Reserve), each fork starts at P's first token with its own and streams on its
own; D's fork tokens that beat P's first token wait; before the first token the forks follow
the request's restarts and end with it; after it each sequence moves alone when its node dies."""

import asyncio

from router_fakes import tokens
from test_core import EOS, RecordingTransport, drain, submit  # noqa: F401
from test_migration import answer_reserve, make_router, tokens_of

from control.protocol import FirstToken, NodeFailed, Prefill, RequestError, Reserve
from router.state import ErrorEvent, RequestState


def idle(r) -> bool:
    return not r.requests and all(
        n.num_active == 0 and n.reserved_pages == 0 and n.queued_tokens == 0
        for n in r.nodes.nodes.values()
    )


def test_one_reserve_and_prefill_then_every_sequence_streams_alone():
    async def main():
        r = make_router()
        req = await submit(r, prompt_len=20, max_new=40, n=3, temperature=1.0, seed=40)
        ((_, reserve),) = r.transport.of(Reserve)
        assert reserve.fork_ids == ["r1/1", "r1/2"] and reserve.sampling["n"] == 3
        # 20 + 32 tokens (4 pages of 16) for the first; each fork shares the prompt's whole
        # page and holds 52 - 16 = 36 tokens (3 pages) of its own.
        assert req.reserved_pages == 4 + 2 * 3
        ((_, prefill),) = r.transport.of(Prefill)
        assert prefill.sampling["n"] == 3
        fork1, fork2 = req.forks
        assert [f.sampling.seed for f in req.forks] == [41, 42] and fork1.sampling.n == 1
        r.handle(tokens("r1/2", [30]))  # D's, before P's first token: waits
        r.handle(FirstToken("r1", 5, 20, fork_tokens=[20, 29]))
        assert [s.state for s in (req, fork1, fork2)] == [RequestState.DECODING] * 3
        assert req.sampling.n == 1 and fork1.decode_node == req.decode_node
        r.handle(tokens("r1", [6, 7], "length"))
        r.handle(tokens("r1/1", [21, EOS], "stop"))
        r.handle(tokens("r1/2", [31], "length"))
        assert tokens_of(drain(req)) == [5, 6, 7] and req.finish_reason == "length"
        assert tokens_of(drain(fork1)) == [20, 21, EOS] and fork1.finish_reason == "stop"
        assert tokens_of(drain(fork2)) == [29, 30, 31] and fork2.finish_reason == "length"
        assert idle(r)

    asyncio.run(main())


def test_before_the_first_token_the_forks_follow_a_restart():
    async def main():
        r = make_router(num_prefill=2)
        req = await submit(r, prompt_len=10, max_new=4, n=2)
        r.handle(NodeFailed(req.prefill_node, "prefill", "killed"))
        _, reserve = await answer_reserve(r, 2)
        assert reserve.request_id == "r1~1" and reserve.fork_ids == ["r1/1~1"]
        (fork,) = req.forks
        assert fork.wire_id == "r1/1~1" and set(r.requests) == {"r1~1", "r1/1~1"}
        r.handle(FirstToken("r1~1", 5, 10, fork_tokens=[8]))
        r.handle(tokens("r1~1", [6, 7, 8], "length"))
        r.handle(tokens("r1/1~1", [9, 10, 11], "length"))
        assert tokens_of(drain(req)) == [5, 6, 7, 8] and tokens_of(drain(fork)) == [8, 9, 10, 11]
        assert idle(r)

    asyncio.run(main())


def test_a_request_failing_before_its_first_token_ends_its_forks():
    async def main():
        r = make_router()
        req = await submit(r, prompt_len=10, max_new=4, n=3)
        r.handle(RequestError("r1", "prefill", "prefill forward failed: boom"))
        for seq in (req, *req.forks):
            (event,) = drain(seq)
            assert isinstance(event, ErrorEvent) and "boom" in event.message
            assert seq.state == RequestState.FAILED
        assert idle(r)

    asyncio.run(main())


def test_after_the_first_token_each_sequence_moves_alone_with_its_own_output():
    async def main():
        r = make_router(num_decode=2)
        req = await submit(r, prompt_len=10, max_new=6, n=2)
        (fork,) = req.forks
        lost = req.decode_node
        r.handle(FirstToken("r1", 5, 10, fork_tokens=[7]))
        r.handle(tokens("r1", [6]))
        r.handle(tokens("r1/1", [8, 9]))
        r.handle(NodeFailed(lost, "decode", "killed"))
        await asyncio.sleep(0.05)  # both moves reserve on the other decode node
        reserves = {m.request_id: m for _, m in r.transport.of(Reserve)}
        assert {"r1~1", "r1/1~1"} <= set(reserves)
        assert reserves["r1~1"].fork_ids == [] and reserves["r1/1~1"].sampling["n"] == 1
        assert reserves["r1~1"].prompt_len == 12 and reserves["r1/1~1"].prompt_len == 13
        assert fork.output_ids == [7, 8, 9] and req.output_ids == [5, 6]

    asyncio.run(main())


def test_a_first_token_without_its_fork_tokens_fails_the_forks_only():
    async def main():
        r = make_router()
        req = await submit(r, prompt_len=10, max_new=3, n=3)
        r.handle(FirstToken("r1", 5, 10, fork_tokens=[6]))  # one of two
        for fork in req.forks:
            (event,) = drain(fork)
            assert isinstance(event, ErrorEvent) and "2 forked sequences" in event.message
        r.handle(tokens("r1", [6, 7], "length"))
        assert tokens_of(drain(req)) == [5, 6, 7] and req.state == RequestState.FINISHED
        assert idle(r)

    asyncio.run(main())
