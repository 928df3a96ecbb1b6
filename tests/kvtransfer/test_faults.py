"""The fault hook of the KV send path (`kvtransfer.faults`): the plan's text form, what each
action does to the message stream, and that it runs on both transports' real senders."""

import logging
import time

import pytest
import torch
from kv_helpers import TIMEOUT, make_pool, random_rows, reserve

from kvtransfer import DropReason, InprocSender, Rendezvous
from kvtransfer.faults import ENV_VAR, FaultInjector, KVFaultPlan, inject, plan_from_env
from kvtransfer.sender_core import ChunkItem, FramedItem, frames_of
from kvtransfer.wire import KVAbort, KVDone

RDV = Rendezvous("r", 7)


def test_plan_text_form():
    plan = KVFaultPlan.parse(" drop=0.1, dup=0.2 ,seed=3, done.corrupt=0.5, chunk#2=delay,hold=4")
    assert plan.rates[("chunk", "drop")] == plan.rates[("abort", "drop")] == 0.1
    assert plan.rates[("done", "dup")] == 0.2 and plan.rates[("done", "corrupt")] == 0.5
    assert ("chunk", "corrupt") not in plan.rates
    assert plan.schedule == {("chunk", 2): "delay"}
    assert (plan.seed, plan.hold, plan.limit, plan.hold_s) == (3, 4, None, 0.0)
    assert KVFaultPlan.parse("limit=5,hold_s=0.5,reorder=1").limit == 5
    assert not KVFaultPlan.parse("seed=4").is_active


@pytest.mark.parametrize(
    "text, error",
    [
        ("explode=0.1", "unknown key"),
        ("drop", "expected key=value"),
        ("drop=1.5", "not a probability"),
        ("drop=0.6,dup=0.6", "sum to 1.2"),
        ("hello.drop=0.1", "unknown message kind"),
        ("chunk#x=drop", "bad item"),
        ("chunk#1=explode", "unknown action"),
        ("hold=0", "hold must be"),
    ],
)
def test_bad_plan_text_is_named(text, error):
    with pytest.raises(ValueError, match=error):
        KVFaultPlan.parse(text)


def test_env_var_read_and_warned(caplog):
    assert plan_from_env({}) is None and plan_from_env({ENV_VAR: " "}) is None
    with caplog.at_level(logging.WARNING, logger="kvtransfer.faults"):
        plan = plan_from_env({ENV_VAR: "drop=0.1,seed=9"})
    assert plan.seed == 9 and "KV FAULT INJECTION IS ON" in caplog.text


class Recorder:
    """A stand-in for a sender's `_submit`: keeps what would have gone out."""

    def __init__(self):
        self.items = []

    def __call__(self, item):
        self.items.append(item)


def _run(plan_text: str, num_chunks: int = 4) -> list:
    """Feeds chunks 0..n-1 and a done of one request through an injector; the delivered items,
    each as its seq ('c<seq>' / 'd<seq>'), or 'x' for a corrupted copy."""
    out = Recorder()
    injector = FaultInjector(KVFaultPlan.parse(plan_text), out)
    for seq in range(num_chunks):
        injector.submit(ChunkItem(RDV, seq, 0, seq, random_rows(1, seed=seq)))
    injector.submit(KVDone(RDV, num_chunks, num_chunks, 1))
    injector.release_all()
    names = {ChunkItem: "c", KVDone: "d", KVAbort: "a"}
    return ["x" if isinstance(i, FramedItem) else f"{names[type(i)]}{i.seq}" for i in out.items]


@pytest.mark.parametrize(
    "plan, delivered",
    [
        ("", ["c0", "c1", "c2", "c3", "d4"]),
        ("chunk#1=drop", ["c0", "c2", "c3", "d4"]),
        ("chunk#1=dup", ["c0", "c1", "c1", "c2", "c3", "d4"]),
        ("chunk#1=reorder", ["c0", "c2", "c1", "c3", "d4"]),
        ("chunk#3=reorder", ["c0", "c1", "c2", "d4", "c3"]),  # a chunk after the done
        ("chunk#0=delay,hold=2", ["c1", "c2", "c0", "c3", "d4"]),
        ("done#0=delay", ["c0", "c1", "c2", "c3", "d4"]),  # nothing later: out at release_all
        ("chunk#2=corrupt", ["c0", "c1", "x", "c3", "d4"]),
        ("drop=1.0,limit=3", ["c3", "d4"]),  # the first three only
    ],
)
def test_actions_on_the_stream(plan, delivered):
    assert _run(plan) == delivered


def test_seeded_plan_is_reproducible():
    text = "drop=0.2,dup=0.2,delay=0.2,reorder=0.2,seed=5"
    runs = [_run(text, num_chunks=40) for _ in range(2)]
    assert runs[0] == runs[1] and runs[0] != _run("", num_chunks=40)
    assert runs[0] != _run(text.replace("seed=5", "seed=6"), num_chunks=40)


def test_corruption_flips_exactly_one_byte():
    for seed in range(20):
        out = Recorder()
        item = ChunkItem(RDV, 0, 0, 0, random_rows(3, seed=seed))
        FaultInjector(KVFaultPlan.parse(f"corrupt=1,seed={seed}"), out).submit(item)
        good = b"".join(bytes(f) for f in frames_of(item))
        bad = b"".join(bytes(f) for f in frames_of(out.items[0]))
        assert len(bad) == len(good) and sum(a != b for a, b in zip(good, bad, strict=True)) == 1


def test_hold_s_releases_without_later_sends():
    out = Recorder()
    injector = FaultInjector(KVFaultPlan.parse("done#0=delay,hold_s=0.05"), out)
    injector.submit(KVDone(RDV, 0, 1, 1))
    assert out.items == [] and injector.num_held == 1
    deadline = time.monotonic() + TIMEOUT
    while not out.items:  # a condition with a bound, not a sleep of the right length
        assert time.monotonic() < deadline, "the held message never went out"
        time.sleep(0.005)
    assert injector.num_held == 0


def test_off_by_default():
    sender = InprocSender()
    assert sender.faults is None and inject(sender, None).faults is None
    assert inject(sender, KVFaultPlan.parse("seed=1")).faults is None  # nothing to do


def test_hook_runs_on_the_real_senders(make_link):
    """Every message duplicated on the wire: the replays are dropped as duplicates (chunks) or
    unknown (the done after the request finished), and the rows are written once."""
    link = make_link(make_pool(page_size=3))
    inject(link.sender, KVFaultPlan.parse("dup=1.0"))
    table, rows = reserve(link.pool, 10), random_rows(10, seed=1)
    link.receiver.expect(RDV, table, 10, time.monotonic() + TIMEOUT)
    link.sender.send_chunk(RDV, 0, 0, rows[:, :6])
    link.sender.send_chunk(RDV, 0, 6, rows[:, 6:])
    link.sender.send_done(RDV, 10, 3)
    (event,) = link.receiver.poll(TIMEOUT)
    assert event.is_ready and event.first_token == 3
    deadline = time.monotonic() + TIMEOUT
    while link.receiver.stats().dropped.get(DropReason.UNKNOWN_RENDEZVOUS, 0) < 1:
        assert time.monotonic() < deadline, "the replayed done never arrived"
        time.sleep(0.002)
    stats = link.receiver.stats()
    assert stats.dropped == {DropReason.DUPLICATE: 2, DropReason.UNKNOWN_RENDEZVOUS: 1}
    assert stats.chunks_written == 2
    assert torch.equal(link.pool.read_rows(table, 0, rows.shape[0], 0, 10), rows)
