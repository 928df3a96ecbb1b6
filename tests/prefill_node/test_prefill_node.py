"""The prefill node loop against a bare in-process KV receiver (no decode node): the rows it
streams are the offline cache rows, the first token is the offline one, and every failure path
(bad request, handshake mismatch, queue timeout, abort, broken sender) tells the router and D
and frees P's pages."""

import time

import pytest
import torch

from control.cluster_config import PrefillNodeConfig, TimeoutConfig
from control.messaging import QueueInbox, QueueOutbox
from control.protocol import (
    Abort,
    FirstToken,
    Heartbeat,
    Prefill,
    RequestError,
    Shutdown,
    sampling_to_dict,
)
from control.sampling_params import SamplingParams
from kvtransfer import InprocReceiver, InprocSender, Rendezvous, make_fingerprint
from model.kv_pool import KVPool
from prefill_node.node import PrefillNode
from runtime.generate import OfflineGenerator

PROMPT_A = [3, 44, 18, 250, 9, 71, 130, 5, 66, 301, 12, 40, 77, 8]
PROMPT_B = list(range(20, 31))
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)
DEADLINE = 30.0


class Rig:
    """A prefill node, the router's queues and one receiver that stands in for D."""

    def __init__(
        self,
        model,
        receiver_dtype=None,
        chunk_size=4,
        max_batch_tokens=8,
        prefix_cache=True,
        **timeouts,
    ):
        cfg = model.cfg
        dtype = receiver_dtype or model.dtype
        pool = KVPool(cfg.num_hidden_layers, 64, 5, cfg.kv_row_width, dtype)
        fp = make_fingerprint(cfg.fingerprint(), cfg.num_hidden_layers, cfg.kv_row_width, dtype)
        self.receiver = InprocReceiver(pool, fp)
        self.inbox, self.outbox = QueueInbox(), QueueOutbox()
        node_cfg = PrefillNodeConfig(
            "p",
            page_size=3,
            chunk_size=chunk_size,
            max_batch_tokens=max_batch_tokens,
            prefix_cache=prefix_cache,
        )
        self.node = PrefillNode(
            "p",
            model,
            node_cfg,
            TimeoutConfig(heartbeat_s=0.05, **timeouts),
            self.inbox,
            self.outbox,
            InprocSender,
        )
        self.tables = {}

    def expect(self, rid, room, num_tokens, deadline_s=DEADLINE):
        table = self.receiver.pool.new_table()
        self.receiver.pool.reserve(table, num_tokens)
        self.receiver.expect(
            Rendezvous(rid, room), table, num_tokens, time.monotonic() + deadline_s
        )
        self.tables[rid] = table
        return table

    def prefill(self, rid, room, prompt, params=GREEDY, endpoint=None, timeout_s=5.0, seq=0):
        endpoint = self.receiver.endpoint if endpoint is None else endpoint
        msg = Prefill(rid, room, prompt, sampling_to_dict(params), endpoint, timeout_s, seq=seq)
        self.inbox.put(msg)

    def step_until(self, cond, what):
        deadline = time.monotonic() + DEADLINE
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.node.step()

    def events(self):
        return {e.rendezvous.request_id: e for e in self.receiver.poll(0.0)}

    def close(self):
        self.node.close("test over")
        self.receiver.close()


@pytest.fixture
def rig(model):
    rig = Rig(model)
    yield rig
    rig.close()


def test_streamed_rows_and_first_token_match_offline(rig, model):
    """Two prompts packed into the same forwards; D's pages (another page size) end up holding
    exactly the rows offline prefill computes, and kv_done carries the offline first token."""
    for rid, prompt in (("a", PROMPT_A), ("b", PROMPT_B)):
        rig.expect(rid, 7, len(prompt))
        rig.prefill(rid, 7, prompt)
    rig.node.step()
    rig.step_until(lambda: not rig.node.scheduler.has_work(), "both prefills")
    events = rig.events()
    offline = OfflineGenerator(model, page_size=16, chunk_size=4)
    num_layers = model.cfg.num_hidden_layers
    for rid, prompt in (("a", PROMPT_A), ("b", PROMPT_B)):
        event = events[rid]
        assert event.is_ready, event.reason
        table = offline.pool.new_table()
        logits = offline.prefill(table, prompt)
        expected_rows = offline.pool.read_rows(table, 0, num_layers, 0, len(prompt))
        offline.pool.release(table)
        got_rows = rig.receiver.pool.read_rows(rig.tables[rid], 0, num_layers, 0, len(prompt))
        torch.testing.assert_close(got_rows, expected_rows, rtol=0, atol=0)
        assert event.first_token == int(logits.argmax())
    assert rig.node.scheduler.num_request_pages == 0


def test_first_token_goes_to_the_router_with_stage_timings(rig, model):
    rig.expect("a", 1, len(PROMPT_A))
    rig.prefill("a", 1, PROMPT_A)
    rig.step_until(lambda: any(isinstance(m, FirstToken) for m in rig.outbox.messages), "token")
    (msg,) = rig.outbox.take(FirstToken)
    expected = OfflineGenerator(model).generate(PROMPT_A, GREEDY).token_ids[0]
    assert msg.token == expected and msg.prompt_len == len(PROMPT_A)
    assert set(msg.stage_ms) == {"queue", "prefill"} and min(msg.stage_ms.values()) >= 0
    assert rig.events()["a"].first_token == expected


@pytest.mark.parametrize(
    "prompt, sampling, match",
    [
        ([], sampling_to_dict(GREEDY), "empty"),
        ([1, 10**6], sampling_to_dict(GREEDY), "outside the vocabulary"),
        ([1] * 600, sampling_to_dict(GREEDY), "context"),
        ([1, 2], {"temperature": "hot"}, "bad request"),
        ([1, 2], {"nucleus": 0.5}, "unknown sampling fields"),
    ],
)
def test_bad_requests_are_refused_with_one_line(rig, prompt, sampling, match):
    rig.inbox.put(Prefill("bad", 1, prompt, sampling, rig.receiver.endpoint, 5.0))
    rig.node.step()
    (error,) = rig.outbox.take(RequestError)
    assert error.request_id == "bad" and error.stage == "prefill" and match in error.message
    assert "\n" not in error.message and not rig.node.scheduler.has_work()


def test_handshake_mismatch_fails_loudly_before_computing(model):
    rig = Rig(model, receiver_dtype=torch.float32)  # the model runs bf16: layouts differ
    rig.prefill("a", 1, PROMPT_A)
    rig.node.step()
    (error,) = rig.outbox.take(RequestError)
    assert error.stage == "transfer" and "dtype" in error.message
    assert not rig.node.scheduler.has_work() and rig.node.scheduler.num_request_pages == 0
    rig.close()


def test_unknown_decode_endpoint_fails_the_request(rig):
    rig.prefill("a", 1, PROMPT_A, endpoint="inproc://nobody-here")
    rig.node.step()
    (error,) = rig.outbox.take(RequestError)
    assert error.stage == "transfer" and "nobody-here" in error.message


def test_queue_timeout_names_its_stage_and_releases_d(model):
    # A one-chunk budget and a long first prompt keep the second one waiting past its deadline.
    rig = Rig(model, chunk_size=4, max_batch_tokens=4)
    pool = rig.node.pool
    pool.allocator.allocate(pool.num_pages - 5)  # room for PROMPT_A (5 pages of 3) only
    rig.expect("first", 1, len(PROMPT_A))
    rig.prefill("first", 1, PROMPT_A)
    rig.expect("late", 2, 5)
    rig.prefill("late", 2, [1, 2, 3, 4, 5], timeout_s=0.001)
    rig.step_until(lambda: any(isinstance(m, RequestError) for m in rig.outbox.messages), "it")
    (error,) = rig.outbox.take(RequestError)
    assert error.request_id == "late" and error.stage == "prefill_queue"
    assert "timed out" in error.message
    events = rig.events()
    assert not events["late"].is_ready and "prefill queue" in events["late"].reason
    rig.step_until(lambda: not rig.node.scheduler.has_work(), "the first prompt")
    assert rig.events()["first"].is_ready
    rig.close()


def test_abort_mid_prefill_frees_pages_and_tells_d(rig):
    rig.expect("a", 1, len(PROMPT_A))
    rig.prefill("a", 1, PROMPT_A)
    rig.node.step()  # one forward: the first chunks went out
    assert rig.receiver.stats().chunks_written > 0 and rig.node.scheduler.num_request_pages > 0
    rig.inbox.put(Abort("a", "client gone"))
    rig.node.step()
    assert rig.node.scheduler.num_request_pages == 0 and not rig.node.scheduler.has_work()
    event = rig.events()["a"]
    assert not event.is_ready and "client gone" in event.reason
    assert rig.outbox.take(RequestError) == [] and rig.outbox.take(FirstToken) == []


def test_a_broken_sender_fails_its_transfers_and_reconnects_later(rig, model):
    rig.expect("a", 1, len(PROMPT_A))
    rig.expect("b", 1, len(PROMPT_B))
    rig.prefill("a", 1, PROMPT_A)
    rig.prefill("b", 1, PROMPT_B)
    rig.node.step()
    endpoint = rig.receiver.endpoint
    rig.receiver.close()  # D went away mid-transfer
    rig.step_until(lambda: not rig.node.scheduler.has_work(), "the failures")
    errors = rig.outbox.take(RequestError)
    assert sorted(e.request_id for e in errors) == ["a", "b"]
    assert all(e.stage == "transfer" for e in errors)
    assert rig.node.scheduler.num_request_pages == 0
    # D comes back at the same endpoint: the next request connects a new sender.
    cfg = model.cfg
    fp = make_fingerprint(cfg.fingerprint(), cfg.num_hidden_layers, cfg.kv_row_width, model.dtype)
    rig.receiver = InprocReceiver(model.new_kv_pool(64, 5), fp, endpoint=endpoint)
    rig.expect("c", 2, len(PROMPT_B))
    rig.prefill("c", 2, PROMPT_B)
    rig.step_until(lambda: rig.outbox.take(FirstToken) or False, "the first token of c")
    assert rig.events()["c"].is_ready


def test_heartbeat_reports_queued_tokens(model):
    rig = Rig(model, chunk_size=4, max_batch_tokens=4)
    rig.expect("a", 1, len(PROMPT_A))
    rig.prefill("a", 1, PROMPT_A, seq=7)
    rig.node.step()
    (hb,) = rig.outbox.take(Heartbeat)
    assert hb.role == "prefill" and hb.queued_tokens == len(PROMPT_A) - 4
    assert hb.num_running == 1 and hb.kv_bytes_sent > 0
    assert hb.prefill_seqs == [7]  # the router's Prefill number 7 is in these figures
    rig.close()


def test_shutdown_fails_queued_requests(rig):
    rig.expect("a", 1, len(PROMPT_A))
    rig.prefill("a", 1, PROMPT_A)
    rig.inbox.put(Shutdown("test"))
    rig.node.run()  # handles both messages, then stops
    (error,) = rig.outbox.take(RequestError)
    assert error.request_id == "a" and "shutting down" in error.message
    assert rig.node.scheduler.num_request_pages == 0
    assert not rig.events()["a"].is_ready


def test_a_failed_node_tells_the_router_first_and_d_nothing(rig):
    """A fatal failure (a tensor-parallel rank died): NodeFailed, then each request's error,
    to the router, which moves them; no kv_abort to D, which would report the request failed
    to the router on its own connection, maybe before the NodeFailed arrives (the router's
    move aborts D's reservation)."""
    rig.expect("a", 1, len(PROMPT_A))
    rig.prefill("a", 1, PROMPT_A)
    rig.node.step()  # the first chunk went out
    rig.node.report_failure(RuntimeError("prefill rank 1 exited"))
    rig.node.close("the prefill node is shutting down")
    sent = [type(m).__name__ for m in rig.outbox.take()]
    assert sent[-2:] == ["NodeFailed", "RequestError"], sent
    assert "a" not in rig.events()  # D heard nothing: its reservation waits for the router
    assert rig.node.scheduler.num_request_pages == 0


def test_a_cached_prefix_is_not_recomputed_and_d_still_gets_every_row(rig, model):
    """PROMPT_A twice: the second computes only the tokens after its cached pages, yet D's
    pages hold exactly the offline rows of the whole prompt and the same first token."""
    offline = OfflineGenerator(model, page_size=16, chunk_size=4)
    table = offline.pool.new_table()
    logits = offline.prefill(table, PROMPT_A)
    num_layers = model.cfg.num_hidden_layers
    expected_rows = offline.pool.read_rows(table, 0, num_layers, 0, len(PROMPT_A))
    offline.pool.release(table)
    computed = []
    forward = rig.node.model.forward
    rig.node.model.forward = lambda batch, pool: (
        computed.append(int(batch.new_lens.sum())),
        forward(batch, pool),
    )[1]
    try:
        for rid in ("cold", "warm"):
            rig.expect(rid, 1, len(PROMPT_A))
            rig.prefill(rid, 1, PROMPT_A)
            rig.node.step()
            rig.step_until(lambda: not rig.node.scheduler.has_work(), f"the {rid} prefill")
    finally:
        rig.node.model.forward = forward
    cache = rig.node.prefix_cache
    # Cold: chunks of 4. Warm: 13 tokens may match, four whole pages of 3: it computes 12, 13.
    assert computed == [4, 4, 4, 2, 2]
    assert (cache.num_lookups, cache.num_hits, cache.num_hit_tokens) == (2, 1, 12)
    events = rig.events()
    for rid in ("cold", "warm"):
        assert events[rid].is_ready and events[rid].first_token == int(logits.argmax())
        got = rig.receiver.pool.read_rows(rig.tables[rid], 0, num_layers, 0, len(PROMPT_A))
        torch.testing.assert_close(got, expected_rows, rtol=0, atol=0)
    assert rig.node.scheduler.num_request_pages == 0


def test_heartbeat_reports_the_prefix_cache(rig):
    for rid in ("a", "b"):
        rig.expect(rid, 1, len(PROMPT_A))
        rig.prefill(rid, 1, PROMPT_A)
        rig.node.step()
        rig.step_until(lambda: not rig.node.scheduler.has_work(), "the prefill")
    rig.node._next_heartbeat = 0.0  # the next step sends one
    rig.node.step()
    hb = rig.outbox.take(Heartbeat)[-1]
    assert (hb.num_prefix_lookups, hb.num_prefix_hits, hb.num_prefix_hit_tokens) == (2, 1, 12)
    assert hb.num_prefix_cached_pages == 4 and hb.num_prefix_cached_tokens == 12
    assert hb.num_prefix_evicted_pages == 0


def test_without_the_cache_every_prompt_is_computed(model):
    rig = Rig(model, prefix_cache=False)
    for rid in ("a", "b"):
        rig.expect(rid, 1, len(PROMPT_A))
        rig.prefill(rid, 1, PROMPT_A)
        rig.node.step()
        rig.step_until(lambda: not rig.node.scheduler.has_work(), "the prefill")
    assert rig.node.prefix_cache is None and rig.node.pool.allocator.num_used == 0
    assert all(e.is_ready for e in rig.events().values())
    rig.close()


def test_heartbeats_go_on_between_the_layers_of_a_long_forward(rig, model):
    """A forward whose every layer outlasts heartbeat_s (a full-depth chunk on one core outlasts
    the router's node timeout) still sends a heartbeat after each layer; the hook is the node's
    only while its forward runs."""

    class Slow:
        def __init__(self, layer):
            self.layer = layer

        def __call__(self, *args):
            time.sleep(0.06)  # > heartbeat_s (0.05): every layer ends past the next beat
            return self.layer(*args)

    layers = model.layers
    rig.expect("a", 1, len(PROMPT_B))
    rig.node.step()  # takes the request in (and beats once)
    rig.outbox.take(Heartbeat)
    model.layers = [Slow(layer) for layer in layers]
    try:
        rig.prefill("a", 1, PROMPT_B[:4])  # one chunk: one forward
        rig.node.step()
    finally:
        model.layers = layers
    assert any(isinstance(m, FirstToken) for m in rig.outbox.messages)
    assert len(rig.outbox.take(Heartbeat)) >= len(layers) - 1  # without the hook: at most 1
    assert model.between_layers is None
