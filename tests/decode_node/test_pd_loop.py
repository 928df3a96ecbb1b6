"""The prefill and decode node loops together (in-process queues and kvtransfer, tiny model):
served output equals OfflineGenerator token for token, continuous batching, abort at every stage
frees every page, incomplete KV is never decoded, every wait is bounded."""

import time

import pytest
import torch
from pd_harness import Pair

from control.cluster_config import TimeoutConfig
from control.protocol import Reserve, ReserveReply, Shutdown, sampling_to_dict
from control.sampling_params import SamplingParams
from decode_node.scheduler import DecodeState
from kvtransfer import InprocSender
from model.deepseek import DeepseekModel
from runtime.generate import OfflineGenerator

PROMPTS = [
    [3, 44, 18, 250, 9, 71, 130, 5, 66, 301, 12, 40, 77, 8],
    [5, 6, 7, 8, 9] * 5,
    [100, 200, 300],
    list(range(10, 31)),
    [7],
]


def greedy(max_new=6, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True, **kw)


@pytest.fixture(params=[True, False], ids=["overlap", "in-order"])
def pair(model, request):
    pair = Pair(model, overlap=request.param)
    yield pair
    pair.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_request_matches_offline_greedy(tiny_dir, dtype):
    model = DeepseekModel.from_pretrained(tiny_dir, dtype=getattr(torch, dtype), progress=False)
    params = greedy(max_new=6)
    expected = OfflineGenerator(model).generate(PROMPTS[0], params).token_ids
    pair = Pair(model)
    assert pair.submit("a", PROMPTS[0], params).ok
    pair.run_all()
    seen = pair.seen["a"]
    assert not seen.errors and seen.output == expected and seen.finish_reason == "length"
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    pair.close()


def test_concurrent_requests_with_continuous_batching(pair, model, offline):
    batches = []
    original = pair.decode._start_step  # every step's forward starts here, overlapped or not
    pair.decode._start_step = lambda batch: (
        batches.append([r.request_id for r in batch]),
        original(batch),
    )[1]
    lengths = [6, 3, 8, 5, 4]
    for i in range(3):
        assert pair.submit(f"r{i}", PROMPTS[i], greedy(lengths[i])).ok
    pair.settle(4)  # r3 and r4 arrive while the others prefill and decode
    for i in (3, 4):
        assert pair.submit(f"r{i}", PROMPTS[i], greedy(lengths[i])).ok
    pair.run_all()
    for i, prompt in enumerate(PROMPTS):
        seen = pair.seen[f"r{i}"]
        assert not seen.errors
        assert seen.output == offline(prompt, greedy(lengths[i])), f"r{i}"
    assert max(len(b) for b in batches) == 3  # max_batch, reached
    assert len({tuple(b) for b in batches}) >= 4  # requests joined and left between steps
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0


def test_seeded_sampling_reproduces_offline(pair, offline):
    params = SamplingParams(temperature=0.9, top_k=50, seed=1234, max_new_tokens=6, ignore_eos=True)
    assert pair.submit("s", PROMPTS[1], params).ok
    pair.run_all()
    assert pair.seen["s"].output == offline(PROMPTS[1], params)


def test_stop_token_ends_the_request_where_offline_does(pair, offline):
    full = offline(PROMPTS[0], greedy(6))
    params = greedy(6, stop_token_ids=(full[3],))
    stop_at = full.index(full[3]) + 1
    assert pair.submit("a", PROMPTS[0], params).ok
    pair.run_all()
    seen = pair.seen["a"]
    assert seen.output == full[:stop_at] and seen.finish_reason == "stop"


def test_first_token_that_stops_is_not_decoded(pair, offline):
    first = offline(PROMPTS[2], greedy(1))[0]
    assert pair.submit("a", PROMPTS[2], greedy(5, stop_token_ids=(first,))).ok
    pair.run_all()
    seen = pair.seen["a"]
    assert seen.output == [first] and seen.token_ids == [] and seen.finish_reason == "stop"
    assert pair.decode_pages_used == 0


def _go_to(pair, stage):
    """Submits request "a" (25 prompt tokens, 7 chunks) and runs the pair until `stage`."""
    params = greedy(30)
    if stage == "reserved":  # D holds pages, P has not heard of it
        assert pair.reserve("a", len(PROMPTS[1]), params)[0].ok
        return
    assert pair.submit("a", PROMPTS[1], params).ok
    if stage == "prefill_queued":  # the Prefill message sits in P's inbox
        return
    if stage == "mid_prefill":  # some chunks reached D, kv_done not yet
        pair.run_until(lambda: pair.receiver.stats().chunks_written > 0, "a first chunk")
        assert pair.seen["a"].first_token is None
    elif stage == "prefill_done":  # kv_done delivered; D has not polled it (only P steps)
        while pair.seen["a"].first_token is None:
            pair.prefill.step()
            pair.collect()
        assert pair.decode.scheduler.get("a").state == DecodeState.AWAITING_KV
    elif stage == "decoding":
        pair.run_until(lambda: len(pair.seen["a"].token_ids) >= 2, "some decoded tokens")
    else:
        raise ValueError(stage)


STAGES = ["reserved", "prefill_queued", "mid_prefill", "prefill_done", "decoding"]


@pytest.mark.parametrize(
    "stage, side",
    [(stage, side) for stage in STAGES for side in ("both", "decode_only")]
    + [("prefill_queued", "prefill_only"), ("mid_prefill", "prefill_only")],
)
def test_abort_at_every_stage_frees_every_page(model, stage, side):
    """The router's Abort reaching both nodes, only D, or only P (P then tells D itself)."""
    pair = Pair(model, chunk_size=4, max_batch_tokens=4)
    used_before = pair.decode_pages_used
    _go_to(pair, stage)
    assert pair.decode_pages_used > used_before
    pair.abort("a", prefill=side != "decode_only", decode=side != "prefill_only")
    pair.settle(1)
    assert pair.decode_pages_used == used_before  # freed at once
    pair.settle(8)  # a P that was not told keeps sending: D drops it all
    seen = pair.seen["a"]
    assert seen.finish_reason is None
    assert pair.decode_pages_used == used_before and pair.prefill_pages_used == 0
    assert not pair.decode.scheduler.requests and not pair.prefill.scheduler.requests
    if side == "prefill_only":  # P's kv_abort reached D, which failed the request itself
        assert [e.stage for e in seen.errors] == ["transfer"]
        assert "aborted" in seen.errors[0].message
    else:
        assert seen.errors == []
    pair.close()


def test_abort_after_decode_finished_is_harmless(pair):
    assert pair.submit("a", PROMPTS[2], greedy(2)).ok
    pair.run_all()
    pair.abort("a")
    pair.settle(2)
    assert pair.seen["a"].finish_reason == "length" and not pair.seen["a"].errors


class DroppingSender(InprocSender):
    """Loses the chunk that starts at token 4 (a lost or corrupted message)."""

    def send_chunk(self, rendezvous, layer_start, token_start, rows, key=None):
        if token_start == 4:
            self._next_seq(rendezvous, is_last=False)
            return
        super().send_chunk(rendezvous, layer_start, token_start, rows, key)


def test_incomplete_kv_is_never_decoded(pair):
    pair.prefill.senders._factory = DroppingSender
    assert pair.submit("a", PROMPTS[1], greedy(5)).ok
    pair.run_all()
    seen = pair.seen["a"]
    assert seen.token_ids == [] and seen.finish_reason is None
    (error,) = seen.errors
    assert error.stage == "transfer" and "incomplete" in error.message
    assert pair.decode_pages_used == 0


class BadTokenSender(InprocSender):
    """Sends a complete KV but a first token outside the vocabulary."""

    def send_done(self, rendezvous, num_tokens, first_token, *more, **kwargs):
        super().send_done(rendezvous, num_tokens, 10**6, *more, **kwargs)


def test_a_first_token_outside_the_vocabulary_is_never_decoded(pair):
    pair.prefill.senders._factory = BadTokenSender
    assert pair.submit("a", PROMPTS[2], greedy(5)).ok
    pair.run_all()
    (error,) = pair.seen["a"].errors
    assert error.stage == "transfer" and "outside the vocabulary" in error.message
    assert pair.seen["a"].token_ids == [] and pair.decode_pages_used == 0


def test_a_transfer_that_never_comes_times_out_and_frees_pages(pair):
    reply, _room = pair.reserve("a", 10, greedy(5), timeout_s=0.05)
    assert reply.ok and pair.decode_pages_used > 0
    pair.run_all()
    (error,) = pair.seen["a"].errors
    assert error.stage == "transfer" and "timed out" in error.message
    assert pair.decode_pages_used == 0


def test_reservation_refused_without_room_says_why(model):
    pair = Pair(model, d_num_pages=4, d_page_size=5)  # 20 tokens of room
    reply, _ = pair.reserve("big", 15, greedy(10))
    assert not reply.ok and "needs 5 KV pages to finish, the pool has 4" in reply.reason
    reply, _ = pair.reserve("fits", 15, greedy(5))
    assert reply.ok
    reply, _ = pair.reserve("next", 1, greedy(1))
    assert not reply.ok and "no room" in reply.reason
    pair.d_in.put(Reserve("bad", 1, 3, {"temperature": -1.0}, 5.0))
    pair.decode.step()
    (reply,) = pair.d_out.take(ReserveReply)
    assert not reply.ok and "temperature" in reply.reason
    pair.close()


def test_decode_timeout_names_its_stage(model):
    pair = Pair(model, timeouts=TimeoutConfig(heartbeat_s=0.05, decode_s=0.0))
    assert pair.submit("a", PROMPTS[2], greedy(20)).ok
    pair.run_all()
    (error,) = pair.seen["a"].errors
    assert error.stage == "decode" and pair.decode_pages_used == 0
    pair.close()


def test_heartbeats_carry_load_figures(pair):
    assert pair.submit("a", PROMPTS[0], greedy(3)).ok
    pair.run_all()
    time.sleep(0.06)  # one heartbeat interval: the next step of each node sends one
    pair.settle(1)
    last = {hb.role: hb for hb in pair.heartbeats}
    d, p = last["decode"], last["prefill"]
    assert d.total_pages == pair.decode.pool.num_pages and d.free_pages == d.total_pages
    assert d.page_size == 5 and d.kv_bytes_received > 0
    assert p.kv_bytes_sent == d.kv_bytes_received and p.queued_tokens == 0
    assert "queue" in p.stage_ms and "decode_step" in d.stage_ms


def test_shutdown_fails_what_is_held_and_frees_it(pair):
    assert pair.submit("a", PROMPTS[1], greedy(30)).ok
    pair.run_until(lambda: len(pair.seen["a"].token_ids) >= 1, "decoding")
    reply, _ = pair.reserve("b", 5, greedy(5))
    assert reply.ok
    pair.d_in.put(Shutdown("test"))
    pair.decode.run()  # returns after the Shutdown, closing the node
    pair.collect()
    assert {rid for rid, s in pair.seen.items() if s.errors} == {"a", "b"}
    assert pair.decode_pages_used == 0
    assert pair.decode.scheduler.count(DecodeState.RUNNING) == 0


def test_late_kv_for_an_aborted_request_is_dropped(pair):
    reply, room = pair.reserve("a", len(PROMPTS[0]), greedy(5))
    pair.abort("a", prefill=False)
    pair.settle(1)
    pair.prefill_only("a", room, PROMPTS[0], greedy(5))  # P was never told: it sends anyway
    pair.settle(8)
    assert pair.decode_pages_used == 0 and not pair.decode.scheduler.requests
    assert pair.receiver.stats().dropped.get("unknown_rendezvous", 0) > 0
    assert pair.seen["a"].token_ids == []
    pair.d_in.put(
        Reserve("a", room + 1, len(PROMPTS[0]), sampling_to_dict(greedy(5)), 5.0)
    )  # the id may be reused with a new room
    pair.decode.step()
    assert pair.decode.scheduler.get("a").room == room + 1
