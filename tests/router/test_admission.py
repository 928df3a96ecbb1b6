"""SLA admission at the router (router/admission.py), driven without sockets like test_core:
the cost models converge on a synthetic node fed through heartbeats; a tiny SLA rejects (503,
Retry-After, the reason) or queues until a heartbeat shows room (then serves, or 503 after
queue_s); "none" serves as before; the pairing only sees nodes predicted to meet the SLA."""

import asyncio
import dataclasses
import random
import time
from collections import deque

import pytest
from router_fakes import fake_config
from test_core import EOS, RecordingTransport, sent_reserves

from control.cost_model import PREFILL_PRIOR, PrefillCost
from control.protocol import FirstToken, Heartbeat, NodeReady, Prefill, Reserve, ReserveReply
from control.sampling_params import SamplingParams
from router.core import Router, RouterError
from router.state import RequestState

TRUTH = (
    0.004,
    3e-5,
    2e-8,
)  # the synthetic prefill node: s per forward, per token, per token*prefix


def make_router(num_prefill=1, **sla):
    r = Router(fake_config(num_prefill, 1, sla=sla), [EOS], max_positions=4096)
    r.transport = RecordingTransport()
    r.transport.num_bad_frames = 0  # /metrics reads it
    for node in r.nodes.nodes.values():
        info = {"num_pages": 1024, "page_size": 16} if node.role == "decode" else {}
        r.handle(NodeReady(node.name, node.role, info))
    return r


def heartbeat(node="p0", queued_tokens=0, samples=(), **kw):
    return Heartbeat(
        node, "prefill", queued_tokens=queued_tokens, timing_samples=list(samples), **kw
    )


def synthetic_samples(rng, n, truth=TRUTH):
    out = []
    for _ in range(n):
        new, attention = rng.randint(1, 512), rng.randint(0, 512 * 2048)
        out.append([new, attention, truth[0] + truth[1] * new + truth[2] * attention])
    return out


def start(r, rid="r1", prompt_len=10, max_new=4):
    prompt = list(range(2, 2 + prompt_len))
    return asyncio.create_task(r.submit(rid, prompt, SamplingParams(max_new_tokens=max_new)))


async def reserve_and_dispatch(r, task, count):
    """Answers the count-th Reserve like a decode node; returns the started request."""
    await sent_reserves(r, count, task)
    _, msg = r.transport.of(Reserve)[-1]
    r.handle(ReserveReply(msg.request_id, True, "tcp://d0-kv"))
    return await task


async def settle(task, rounds=20):
    for _ in range(rounds):
        await asyncio.sleep(0)
    return task.done()


def rejections(r, reason):
    return r.metrics.rejections.labels(reason)._value.get()


def test_the_cost_model_converges_on_a_synthetic_node():
    r = make_router()
    node = r.nodes.nodes["p0"]
    prior = r.admission.predict(node, 1000)
    expected_prior = PrefillCost(PREFILL_PRIOR).predict_prompt(1000, 0, 256)
    assert prior.ttft_s == pytest.approx(expected_prior)  # no sample yet: the prior
    rng = random.Random(3)
    for _ in range(40):  # 40 heartbeats of 16 forwards each
        r.handle(heartbeat(samples=synthetic_samples(rng, 16)))
    assert r.admission.prefill_cost["p0"].num_samples == 640
    assert r.admission.prefill_cost["p0"].model.weights == pytest.approx(TRUTH, rel=1e-3)
    # The prediction is now the synthetic node's: 1000 tokens in chunks of 256 (256 default).
    chunks = [(256, 0), (256, 256), (256, 512), (232, 768)]
    exact = sum(TRUTH[0] + TRUTH[1] * n + TRUTH[2] * n * p for n, p in chunks)
    assert r.admission.predict(node, 1000).ttft_s == pytest.approx(exact, rel=1e-3)
    # The queue ahead is the node's reported work, costed the same way.
    r.handle(heartbeat(queued_tokens=512, queued_attention=512 * 100, queued_forwards=2))
    queue = r.admission.predict(node, 1000).queue_s
    assert queue == pytest.approx(2 * TRUTH[0] + 512 * TRUTH[1] + 51200 * TRUTH[2], rel=1e-3)
    # Decode nodes' step samples calibrate their model too.
    steps = [[b, b * 300, 0.002 + 1e-4 * b + 1e-7 * b * 300] for b in range(1, 33)]
    for _ in range(20):
        r.handle(Heartbeat("d0", "decode", timing_samples=steps))
    assert r.admission.decode_cost["d0"].predict(8, 4000) == pytest.approx(
        0.002 + 8e-4 + 4e-4, rel=1e-2
    )


def test_garbled_samples_are_ignored():
    r = make_router()
    r.handle(heartbeat(samples=[[1, 2], [float("nan"), 1, 1], [-1, 0, 0.1], [4, 0, 0.01]]))
    assert r.admission.prefill_cost["p0"].num_samples == 1


def test_reject_with_a_tiny_sla_is_503_saying_why():
    async def main():
        r = make_router(ttft_ms=0.001, admission="reject")
        with pytest.raises(RouterError) as err:
            await start(r)
        e = err.value
        assert e.status == 503 and e.code == "sla_unmet" and e.retry_after >= 1
        assert "TTFT SLA cannot be met now" in e.message and "ttft_ms = 0.001" in e.message
        assert "predicted time to first token" in e.message
        assert not r.transport.of(Reserve) and not r.requests  # nothing was started
        assert rejections(r, "sla") == 1
        assert 'duet_rejections_total{reason="sla"} 1.0' in r.metrics.render().decode()

    asyncio.run(main())


def test_none_serves_a_request_that_misses_the_sla():
    async def main():
        r = make_router(ttft_ms=0.001, admission="none")
        req = await reserve_and_dispatch(r, start(r), 1)
        assert req.state == RequestState.PREFILLING and len(r.transport.of(Prefill)) == 1
        assert rejections(r, "sla") == 0

    asyncio.run(main())


def test_queue_waits_for_a_heartbeat_with_room_then_serves():
    async def main():
        # 10 tokens alone: ~1 ms on the prior; behind 10^6 queued tokens: seconds.
        r = make_router(ttft_ms=50, admission="queue", queue_s=60)
        r.handle(heartbeat(queued_tokens=10**6, queued_forwards=4000))
        task = start(r)
        assert not await settle(task) and not r.transport.of(Reserve)  # waiting at the router
        assert r.admission.num_waiting == 1  # it counts toward max_queued_requests
        r.handle(heartbeat(queued_tokens=10**6, queued_forwards=4000))  # still full: waits on
        assert not await settle(task) and not r.transport.of(Reserve)
        r.handle(heartbeat(queued_tokens=0))  # the queue drained
        req = await reserve_and_dispatch(r, task, 1)
        assert req.state == RequestState.PREFILLING and len(r.transport.of(Prefill)) == 1
        assert rejections(r, "sla") == 0 and r.admission.num_waiting == 0

    asyncio.run(main())


def test_requests_queued_for_the_sla_count_toward_the_router_limit():
    async def main():
        r = make_router(ttft_ms=50, admission="queue", queue_s=60)
        r.cfg = dataclasses.replace(
            r.cfg, router=dataclasses.replace(r.cfg.router, max_queued_requests=1)
        )
        r.handle(heartbeat(queued_tokens=10**6, queued_forwards=4000))
        waiting = start(r, "r1")
        await settle(waiting)
        with pytest.raises(RouterError) as err:
            await start(r, "r2")
        assert err.value.code == "overloaded"
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())


def test_queue_gives_up_after_queue_s_with_503():
    async def main():
        r = make_router(ttft_ms=50, admission="queue", queue_s=0.05)
        r.handle(heartbeat(queued_tokens=10**6, queued_forwards=4000))
        with pytest.raises(RouterError) as err:
            await asyncio.wait_for(start(r), 10)
        assert err.value.status == 503 and "after waiting 0.05 s" in err.value.message
        assert not r.transport.of(Reserve) and not r.requests and rejections(r, "sla") == 1

    asyncio.run(main())


def test_a_cancelled_wait_leaves_nothing_behind():
    async def main():
        r = make_router(ttft_ms=50, admission="queue", queue_s=60)
        r.handle(heartbeat(queued_tokens=10**6, queued_forwards=4000))
        task = start(r)
        await settle(task)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not r.requests and not r.admission._admitted
        r.handle(heartbeat(queued_tokens=0))  # waking nobody is harmless

    asyncio.run(main())


def test_a_burst_admitted_together_sees_its_own_queue():
    async def main():
        # On the prior one 10-token prompt takes ~1.05 ms: one fits 1.5 ms, two in a row do not.
        r = make_router(ttft_ms=1.5, admission="reject")
        first = start(r, "r1")
        await sent_reserves(r, 1, first)  # admitted, now reserving (not yet dispatched)
        with pytest.raises(RouterError):
            await start(r, "r2")
        await reserve_and_dispatch(r, first, 1)
        ((_, prefill),) = r.transport.of(Prefill)
        assert prefill.seq == 1  # the router numbers its Prefills to each node
        with pytest.raises(RouterError):  # dispatched, not yet in a heartbeat: still counted
            await start(r, "r3")
        # A heartbeat of a node that has not taken that Prefill yet (it was in a forward) does
        # not include it, however late it comes: still counted.
        r.handle(heartbeat(queued_tokens=0, prefill_seqs=[0]))
        with pytest.raises(RouterError):
            await start(r, "r3b")
        r.handle(heartbeat(queued_tokens=0, prefill_seqs=[1]))  # taken, and P holds nothing
        await reserve_and_dispatch(r, start(r, "r4"), 2)

    asyncio.run(main())


def test_pairing_only_sees_nodes_that_meet_the_sla():
    async def main():
        r = make_router(num_prefill=2, ttft_ms=50, admission="reject")
        r.handle(heartbeat("p0", queued_tokens=10**6, queued_forwards=4000))  # p0 is swamped
        for i in range(3):  # least-loaded alone would alternate p0, p1 (router counts tie)
            await reserve_and_dispatch(r, start(r, f"r{i}"), i + 1)
        assert [n for n, _ in r.transport.of(Prefill)] == ["p1"] * 3

    asyncio.run(main())


def test_first_token_records_the_prediction_error():
    async def main():
        r = make_router()
        req = await reserve_and_dispatch(r, start(r), 1)
        r.handle(FirstToken(req.wire_id, 7, req.prompt_len))
        text = r.metrics.render().decode()
        assert "duet_ttft_prediction_error_seconds_count 1.0" in text
        assert 'duet_cost_model_weight{node="p0",role="prefill",term="per_token"}' in text
        assert "duet_goodput_requests_per_second" in text
        assert not r.admission._admitted

    asyncio.run(main())


def test_transfer_term_uses_the_kv_layout_from_node_ready():
    r = make_router(kv_bytes_per_s=1e6)
    fingerprint = {"num_layers": 4, "row_width": 100, "dtype": "bfloat16"}  # 800 bytes a token
    r.handle(NodeReady("p0", "prefill", {"fingerprint": fingerprint}))
    node = r.nodes.nodes["p0"]
    assert r.admission.predict(node, 100).transfer_s == pytest.approx(100 * 800 / 1e6)
    # Only the last chunk's rows (256 tokens a chunk here) are sent after the compute.
    assert r.admission.predict(node, 1000).transfer_s == pytest.approx(256 * 800 / 1e6)


def test_a_cached_prefix_shortens_the_predicted_prefill():
    """With cache-aware pairing, the prediction counts the prompt tokens the node is expected
    to serve from its prefix cache (what its cache holds, and the prompts queued on it)."""
    r = make_router()
    node = r.nodes.nodes["p0"]
    prompt = list(range(2, 2 + 1024))
    cold = r.admission.ranked([node], prompt)[0]
    assert r.admission.cached_len(node, prompt) == 0
    node.in_flight[1] = prompt  # sent there (`NodeRegistry.hold_prefill`): it will cache it
    cached = r.admission.cached_len(node, prompt)
    assert cached == 1023 // node.page_size * node.page_size  # whole pages, never the last token
    warm = r.admission.ranked([node], prompt)[0]
    expected = PrefillCost(PREFILL_PRIOR).predict_prompt(1024, cached, 256)
    assert warm.prefill_s == pytest.approx(expected) and warm.prefill_s < cold.prefill_s / 5


def test_later_arrivals_packed_into_its_forwards_lengthen_the_prediction():
    """A prompt's forwards carry the chunks of prompts arriving meanwhile (up to
    max_batch_tokens): at the tokens/s the router has been sending the node, the prediction
    adds what arrives during the prompt's own prefill, never more than its forwards hold."""
    r = make_router()
    node, prior = r.nodes.nodes["p0"], PrefillCost(PREFILL_PRIOR)
    alone = r.admission.predict(node, 256).prefill_s
    assert alone == pytest.approx(prior.predict_forward(256, 0, 1))  # idle: nothing arrives
    assert r.admission.arrival_rate("p0") == 0.0
    now = time.monotonic()
    r.admission._arrivals["p0"] = deque([(now, 1000)])  # 1000 tokens in the 10 s window
    rate = r.admission.arrival_rate("p0", now)
    assert rate == pytest.approx(100.0)
    some = r.admission.predict(node, 256).prefill_s
    assert some == pytest.approx(prior.predict_forward(256 + rate * alone, 0, 1), rel=1e-3)
    r.admission._arrivals["p0"] = deque([(now, 10**9)])  # a flood: the forward is full
    full = r.admission.predict(node, 256).prefill_s
    assert full == pytest.approx(prior.predict_forward(512, 0, 1))  # max_batch_tokens = 512
    r.admission._arrivals["p0"] = deque([(now - 11.0, 10**9)])  # older than the window
    assert r.admission.arrival_rate("p0") == 0.0
