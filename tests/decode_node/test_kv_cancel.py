"""The decode node tells the prefill node to stop (kv_cancel), on the real node loops over the
in-process transport: when D gives up on a request whose KV is still coming (the router's Abort
reached D, its transfer deadline passed, it shuts down), P stops before computing the rest of the
prompt and frees its pages, without a word to the router (D has told it, or heard from it); when D
refuses the KV as incomplete, P is told too; a cancel of another attempt or endpoint changes
nothing.

The loops are driven step by step: with chunk_size = max_batch_tokens = 4, one prefill step
computes and sends exactly one chunk of LONG (25 tokens: 7 chunks), so the chunk counts are exact.
"""

import time
from collections import Counter

import pytest
from pd_harness import Pair

from control.sampling_params import SamplingParams
from kvtransfer import InprocReceiver, InprocSender, Rendezvous
from kvtransfer.faults import KVFaultPlan, inject
from kvtransfer.wire import KVCancel, encode

LONG = [5, 6, 7, 8, 9] * 5  # 25 tokens: 7 chunks of 4
NUM_CHUNKS = 7
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
DEADLINE_S = 1.0  # the transfer deadline of the test that waits for it


class Link:
    """The prefill node's sender factory: in-process senders (with `plan` injected) that record
    each chunk the node sends and each cancel it polls."""

    def __init__(self, plan: str = ""):
        self.plan = KVFaultPlan.parse(plan) if plan else None
        self.chunks_sent: Counter[str] = Counter()  # request id -> send_chunk calls
        self.cancels: list[tuple[Rendezvous, str]] = []

    def __call__(self) -> InprocSender:
        link = self

        class Recording(InprocSender):
            def send_chunk(self, rendezvous, layer_start, token_start, rows, key=None):
                link.chunks_sent[rendezvous.request_id] += 1
                super().send_chunk(rendezvous, layer_start, token_start, rows, key)

            def poll_cancels(self):
                cancels = super().poll_cancels()
                link.cancels += cancels
                return cancels

        return inject(Recording(), self.plan)


def count_computed(pair: Pair) -> Counter:
    """request id -> chunks the prefill node computed for it (from here on)."""
    computed: Counter[str] = Counter()
    run_chunks = pair.prefill._run_chunks

    def counting(chunks):
        computed.update(c.request.request_id for c in chunks)
        run_chunks(chunks)

    pair.prefill._run_chunks = counting
    return computed


def last_prefill_heartbeat(pair: Pair):
    pair.prefill._next_heartbeat = 0.0  # due now
    pair.prefill.step()
    pair.collect()
    return [hb for hb in pair.heartbeats if hb.role == "prefill"][-1]


@pytest.mark.parametrize("cause", ["abort", "deadline", "shutdown"])
def test_decode_giving_up_mid_transfer_stops_the_prefill(model, offline, cause):
    link = Link()
    pair = Pair(model, chunk_size=4, max_batch_tokens=4, sender_factory=link)
    computed = count_computed(pair)
    reserved_at = time.monotonic()
    assert pair.submit("a", LONG, PARAMS, timeout_s=DEADLINE_S).ok
    rdv = Rendezvous("a", pair.decode.scheduler.get("a").room)
    pair.prefill.step()
    pair.prefill.step()
    assert computed["a"] == 2 and pair.receiver.stats().chunks_written == 2
    assert pair.prefill_pages_used > 0

    if cause == "abort":  # the router's Abort reaches D (P's copy is still on its way)
        pair.abort("a", prefill=False)
        pair.decode.step()
    elif cause == "deadline":
        while time.monotonic() <= reserved_at + DEADLINE_S:  # the deadline is what is tested
            time.sleep(0.01)
        pair.decode.step()
    else:
        pair.decode.close("the decode node is shutting down")
    assert pair.decode_pages_used == 0
    pair.prefill.step()  # takes the cancel: "a" stops before its third chunk

    assert computed["a"] == 2 and link.chunks_sent["a"] == 2  # of NUM_CHUNKS
    assert pair.prefill_pages_used == 0 and not pair.prefill.scheduler.requests
    (_, reason), *more = link.cancels
    assert link.cancels[0][0] == rdv and not more
    pair.collect()
    seen = pair.seen["a"]
    assert seen.first_token is None
    # One error at most, and it is D's: P says nothing of a request D gave up on.
    expected = {"abort": [], "deadline": ["transfer"], "shutdown": ["decode"]}[cause]
    assert [e.stage for e in seen.errors] == expected
    assert all(e.message == reason for e in seen.errors)  # the very reason P was given
    assert pair.receiver.stats().dropped == {}  # nothing late reached D: P sent nothing more
    assert pair.prefill.num_cancelled_by_decode == 1
    assert last_prefill_heartbeat(pair).num_cancelled_by_decode == 1

    if cause != "shutdown":  # both nodes serve the next request on the pages that came back
        assert pair.submit("b", LONG, PARAMS).ok
        pair.run_until(lambda: pair.seen["b"].is_over)
        assert pair.seen["b"].output == offline(LONG, PARAMS) and not pair.seen["b"].errors
        assert computed["b"] == NUM_CHUNKS
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    pair.close()


def test_kv_refused_as_incomplete_tells_the_prefill(model):
    """The third chunk is lost on the way: D refuses kv_done as incomplete and tells P, which
    has finished the prompt by then (kv_done is its last message): nothing left to stop."""
    link = Link("chunk#2=drop")
    pair = Pair(model, chunk_size=4, max_batch_tokens=4, sender_factory=link)
    computed = count_computed(pair)
    assert pair.submit("a", LONG, PARAMS).ok
    rdv = Rendezvous("a", pair.decode.scheduler.get("a").room)
    pair.run_all()
    (error,) = pair.seen["a"].errors
    assert error.stage == "transfer"
    assert "incomplete, layer 0 token 8 never arrived" in error.message
    pair.settle(1)  # P polls the cancel at its next step
    assert link.cancels == [(rdv, error.message)]
    assert computed["a"] == NUM_CHUNKS and pair.prefill.num_cancelled_by_decode == 0
    assert pair.seen["a"].first_token is not None  # P finished, and said so, before the refusal
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    assert not pair.decode.scheduler.requests and not pair.prefill.scheduler.requests
    pair.close()


def test_a_cancel_of_another_attempt_or_endpoint_is_ignored(model, offline):
    link = Link()
    pair = Pair(model, chunk_size=4, max_batch_tokens=4, sender_factory=link)
    other = InprocReceiver(model.new_kv_pool(8, 5), pair.receiver.fingerprint)
    try:
        assert pair.submit("a", LONG, PARAMS).ok
        room = pair.decode.scheduler.get("a").room
        pair.prefill.step()
        sender = pair.prefill.senders.peek(pair.receiver.endpoint)
        for stale in (Rendezvous("a", room + 1), Rendezvous("b", room)):  # another attempt / id
            sender._from_receiver([encode(KVCancel(stale, "an earlier attempt"))])
        # The right rendezvous, from a decode node "a" does not send to.
        stranger = pair.prefill.senders.get(other.endpoint)
        stranger._from_receiver([encode(KVCancel(Rendezvous("a", room), "not mine"))])
        pair.run_all()
        seen = pair.seen["a"]
        assert not seen.errors and seen.output == offline(LONG, PARAMS)
        assert len(link.cancels) == 3 and pair.prefill.num_cancelled_by_decode == 0
        assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    finally:
        other.close()
        pair.close()
