"""The router fans one StepTokens (a decode step's output for several requests) out to each
request's stream: each gets its own tokens and logprobs, a finished one ends (pages released,
counted), one whose P first token has not arrived yet holds them until it does, and entries of
aborted or unknown requests are ignored. The oracle: the same entries delivered one request per
message (as a decode step of one request sends them) give every stream the same events."""

import asyncio

from router_fakes import tokens
from test_core import drain, make_router, submit

from control.logprobs import TokenLogprobs
from control.protocol import FirstToken, RequestTokens, StepTokens
from router.state import ErrorEvent, RequestState, TokenEvent

STEP = [
    RequestTokens("r1", [11, 12], "length"),  # its last two tokens (max_new 3)
    RequestTokens("r2", [21], None, [-0.5], [[21, 4]], [[-0.5, -1.5]]),  # asked for logprobs
    RequestTokens("r3", [31]),  # aborted by its client: ignored
    RequestTokens("r4", [41]),  # before P's first token: waits for it
    RequestTokens("gone", [1]),  # unknown (an old attempt's, say): ignored
]


def run(deliver):
    """Four requests; the STEP entries delivered by `deliver(router, entries)`; what each
    stream saw, and the router's state after."""

    async def main():
        r = make_router()
        reqs = {}
        for rid, max_new, extra in (
            ("r1", 3, {}),
            ("r2", 10, {"logprobs": 1}),
            ("r3", 10, {}),
            ("r4", 10, {}),
        ):
            reqs[rid] = await submit(r, rid, max_new=max_new, **extra)
        for rid in ("r1", "r2", "r3"):
            r.handle(
                FirstToken(
                    rid,
                    10,
                    10,
                    logprob=[-0.1] if rid == "r2" else [],
                    top_ids=[10] if rid == "r2" else [],
                    top_logprobs=[-0.1] if rid == "r2" else [],
                )
            )
        r.abort(reqs["r3"], "client went away")
        deliver(r, STEP)
        before_first = drain(reqs["r4"])
        r.handle(FirstToken("r4", 40, 10))
        events = {rid: drain(req) for rid, req in reqs.items()}
        state = {
            rid: (req.state, req.num_output_tokens, rid in r.requests) for rid, req in reqs.items()
        }
        held = [req.reserved_pages for rid, req in reqs.items() if req.holds_decode]
        pages = (r.nodes.nodes["d0"].reserved_pages, len(held), sum(held))
        return before_first, events, state, pages

    return asyncio.run(main())


def test_one_step_message_reaches_every_stream():
    before_first, events, state, pages = run(lambda r, entries: r.handle(StepTokens.of(entries)))
    assert before_first == []
    assert events["r1"] == [TokenEvent([10], None), TokenEvent([11, 12], "length")]
    lp = TokenLogprobs(-0.5, [21, 4], [-0.5, -1.5])
    assert events["r2"] == [
        TokenEvent([10], None, [TokenLogprobs(-0.1, [10], [-0.1])]),
        TokenEvent([21], None, [lp]),
    ]
    assert events["r3"] == [TokenEvent([10], None), ErrorEvent("client", "client went away")]
    assert events["r4"] == [TokenEvent([40, 41], None)]
    assert state["r1"] == (RequestState.FINISHED, 3, False)  # ended, forgotten
    assert state["r2"] == (RequestState.DECODING, 2, True)
    assert state["r3"] == (RequestState.FAILED, 1, False)
    assert state["r4"] == (RequestState.DECODING, 2, True)
    node_pages, num_holding, held = pages
    assert num_holding == 2 and node_pages == held > 0  # r2's and r4's; r1's, r3's released


def test_one_message_per_step_equals_one_message_per_request():
    batched = run(lambda r, entries: r.handle(StepTokens.of(entries)))

    def one_by_one(r, entries):
        for e in entries:
            r.handle(
                tokens(
                    e.request_id,
                    e.token_ids,
                    e.finish_reason,
                    logprobs=e.logprobs,
                    top_ids=e.top_ids,
                    top_logprobs=e.top_logprobs,
                )
            )

    assert batched == run(one_by_one)
