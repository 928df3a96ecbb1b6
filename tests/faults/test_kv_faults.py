"""KV frames dropped, duplicated, delayed, reordered and corrupted between a prefill and a decode
node, by the fault hook of the prefill node's sender (`kvtransfer.faults`): the real node loops,
the real transports, nothing mocked.

After every fault run:
- every request ended with a completion whose greedy tokens equal the offline oracle, or with
  one RequestError of stage "transfer" and no decoded token: never garbage from bad KV;
- no request waited past its stated bound (the harness's loops fail after TIMEOUT);
- requests none of whose messages were faulted completed; the nodes serve new requests after;
- both KV pools are back at their baseline (no page used) and no node holds a request.

(a) In process: `Pair` steps both loops on this thread over the in-process transport, so a seeded
    plan gives the same run every time. Waits are loops on a condition with a bound, never
    sleeps; only the tests of a deadline wait for one (of TRANSFER_S or SHORT_S).
(b) End to end: `duet up` 1P1D with DUET_KV_FAULTS in its prefill node, 16 concurrent streams of
    the official openai client (the last tests of this module). A failed transfer is a new
    attempt at the router (`router.recovery`), so every stream completes with the oracle's
    tokens.
"""

import asyncio
import re
import time

import httpx
import openai
import pytest
import torch

from control.sampling_params import SamplingParams
from deploy.local_cluster import dump_toml
from kvtransfer import DropReason, InprocSender
from kvtransfer.faults import ENV_VAR, KVFaultPlan, inject
from model.deepseek import DeepseekModel
from runtime.generate import OfflineGenerator
from tests.decode_node.pd_harness import TIMEOUT, Pair
from tests.e2e.e2e_helpers import (
    alive,
    cluster_shorthand,
    generate_reference,
    processes_mentioning,
    start_cluster,
)
from tests.e2e.e2e_helpers import (
    wait_until as _wait,
)

PROMPTS = [
    [3, 44, 18, 250, 9, 71, 130, 5, 66, 301, 12, 40, 77, 8],
    [5, 6, 7, 8, 9] * 5,
    [100, 200, 300],
    list(range(10, 31)),
    [7],
    [400, 12, 9, 9, 31, 2, 250, 77, 6, 1, 8],
    list(range(60, 78)),
    [11, 22, 33, 44, 55, 66, 77],
]
LONG = PROMPTS[1]  # 25 tokens: 7 chunks of 4
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
TRANSFER_S = 5.0  # each request's KV deadline (the harness's default)
SHORT_S = 0.5  # the deadline of a request whose end message is lost or held on purpose


@pytest.fixture(scope="module", autouse=True)
def nodes_use_one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def model(tiny_dir):
    """float32: a request's greedy tokens then do not depend on what it was batched with (in
    bfloat16 they do, here and there, so a fault that changes the batches would change them)."""
    return DeepseekModel.from_pretrained(tiny_dir, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def offline(model):
    """offline(prompt, params) -> OfflineGenerator's tokens for the float32 model (the oracle)."""
    generator, cache = OfflineGenerator(model, page_size=16, chunk_size=256), {}

    def run(prompt, params):
        key = (tuple(prompt), params)
        if key not in cache:
            cache[key] = generator.generate(list(prompt), params).token_ids
        return cache[key]

    return run


class FaultyLink:
    """The prefill node's sender factory: in-process senders with `plan` injected."""

    def __init__(self, plan: str):
        self.plan = KVFaultPlan.parse(plan)
        self.senders: list[InprocSender] = []

    def __call__(self) -> InprocSender:
        self.senders.append(inject(InprocSender(), self.plan))
        return self.senders[-1]

    @property
    def records(self):
        return [r for s in self.senders if s.faults for r in s.faults.records]

    def release_all(self) -> None:
        for sender in self.senders:
            if sender.faults is not None:
                sender.faults.release_all()

    def heal(self) -> None:
        """The link is good again: what it still held goes out, nothing more is faulted."""
        self.release_all()
        for sender in self.senders:
            sender.faults = None


@pytest.fixture
def faulty_pair(model):
    """faulty_pair(plan, **pair_options) -> (Pair, FaultyLink); closed after the test."""
    pairs = []

    def make(plan: str, **kw) -> tuple[Pair, FaultyLink]:
        link = FaultyLink(plan)
        pairs.append(Pair(model, sender_factory=link, **kw))
        return pairs[-1], link

    yield make
    for pair in pairs:
        pair.close()


def serve(pair: Pair, link: FaultyLink, prompts: dict[str, list[int]], timeout_s=TRANSFER_S):
    """Submits every prompt at once and steps until each request ended (bounded by TIMEOUT).
    Once the prefill node has nothing left to send, the link hands over what it still held:
    a delayed message arrives late, it is not lost."""
    for rid, prompt in prompts.items():
        assert pair.submit(rid, prompt, PARAMS, timeout_s).ok
    deadline = time.monotonic() + TIMEOUT
    while not all(pair.seen[rid].is_over for rid in prompts):
        assert time.monotonic() < deadline, f"requests still open after {TIMEOUT:g} s"
        if not pair.prefill.scheduler.requests:
            link.release_all()
        pair.step()


def check_invariants(pair: Pair, link: FaultyLink, prompts, offline) -> dict[str, str]:
    """The module's invariants; returns each request's outcome, "completed" or "failed"."""
    outcomes = {}
    for rid, prompt in prompts.items():
        seen = pair.seen[rid]
        if seen.errors:
            assert [e.stage for e in seen.errors] == ["transfer"], f"{rid}: {seen.errors}"
            assert seen.token_ids == [] and seen.finish_reason is None, f"{rid} was decoded"
            outcomes[rid] = "failed"
        else:
            assert seen.output == offline(prompt, PARAMS), f"{rid} decoded from bad KV"
            assert seen.finish_reason == "length"
            outcomes[rid] = "completed"
    faulted = {r.rendezvous.request_id for r in link.records}
    for rid in set(prompts) - faulted:
        assert outcomes[rid] == "completed", f"{rid} failed though none of its messages was"
    stats = pair.receiver.stats()
    assert stats.num_ready + stats.num_failed == len(prompts)  # one event per expectation
    # Late frames still held arrive now: dropped, no page touched, no event.
    link.release_all()
    pair.settle(2)
    assert pair.receiver.poll() == []
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    assert not pair.decode.scheduler.requests and not pair.prefill.scheduler.requests
    return outcomes


def check_serves_after(pair: Pair, link: FaultyLink, offline) -> None:
    """With the link healed, new requests (on pages the faulted ones used) all complete."""
    link.heal()
    fresh = {f"after-{i}": PROMPTS[i] for i in (0, 1, 3)}
    serve(pair, link, fresh)
    for rid, prompt in fresh.items():
        seen = pair.seen[rid]
        assert not seen.errors and seen.output == offline(prompt, PARAMS), rid
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0


# ---- (a) seeded plans, one fault class at a time, then all mixed ----------------------------

CLASSES = {
    "drop": "drop=0.12,seed=11",
    "dup": "dup=0.3,seed=12",
    "delay": "delay=0.25,hold=3,seed=13",
    "reorder": "reorder=0.25,seed=14",
    "corrupt": "corrupt=0.15,seed=15",
    "mixed": "drop=0.04,dup=0.1,delay=0.1,reorder=0.1,corrupt=0.06,seed=16",
}


@pytest.mark.parametrize("name", list(CLASSES))
def test_seeded_fault_class(faulty_pair, offline, name):
    pair, link = faulty_pair(CLASSES[name])
    prompts = {f"r{i}": p for i, p in enumerate(PROMPTS)}
    serve(pair, link, prompts)
    outcomes = check_invariants(pair, link, prompts, offline)
    actions = {r.action for r in link.records}
    assert actions == (
        {"drop", "dup", "delay", "reorder", "corrupt"} if name == "mixed" else {name}
    )
    lossy = {r.rendezvous.request_id for r in link.records if r.action == "drop"}
    assert all(outcomes[rid] == "failed" for rid in lossy), "a request lost a message"
    num_failed = sum(o == "failed" for o in outcomes.values())
    if name == "dup":  # replays are idempotent: never double counted, never a failure
        assert num_failed == 0
        assert pair.receiver.stats().dropped.get(DropReason.DUPLICATE, 0) >= 1
    elif name in ("drop", "corrupt", "reorder", "mixed"):  # the plan reached the failure path
        assert num_failed >= 1
    assert num_failed < len(prompts)
    check_serves_after(pair, link, offline)


# ---- (a) each case of the issue, with an explicit schedule ----------------------------------


def test_dropped_chunk_refuses_kv_done_as_incomplete(faulty_pair, offline):
    pair, link = faulty_pair("chunk#2=drop")
    serve(pair, link, {"a": LONG})
    (error,) = pair.seen["a"].errors
    assert (
        error.stage == "transfer" and "incomplete, layer 0 token 8 never arrived" in error.message
    )
    check_invariants(pair, link, {"a": LONG}, offline)
    check_serves_after(pair, link, offline)


def test_duplicated_chunks_count_once(faulty_pair, offline):
    pair, link = faulty_pair("dup=1.0")  # every message twice, same sequence number
    prompts = {"a": LONG, "b": PROMPTS[0]}
    serve(pair, link, prompts)
    assert check_invariants(pair, link, prompts, offline) == {"a": "completed", "b": "completed"}
    stats = pair.receiver.stats()
    num_chunks = 7 + 4  # 25 and 14 tokens in chunks of 4
    assert stats.chunks_written == num_chunks
    assert stats.dropped[DropReason.DUPLICATE] == num_chunks
    assert stats.dropped[DropReason.UNKNOWN_RENDEZVOUS] == 2  # each replayed kv_done


def test_chunk_reordered_after_done_is_refused_then_dropped(faulty_pair, offline):
    pair, link = faulty_pair("chunk#6=reorder")  # the last chunk swaps with kv_done
    serve(pair, link, {"a": LONG})
    (error,) = pair.seen["a"].errors
    assert error.stage == "transfer" and "incomplete" in error.message
    assert pair.receiver.stats().dropped == {DropReason.UNKNOWN_RENDEZVOUS: 1}
    check_invariants(pair, link, {"a": LONG}, offline)


def test_chunks_reordered_within_a_request_are_refused(faulty_pair, offline):
    pair, link = faulty_pair("chunk#1=reorder")  # chunk 1 arrives after chunk 2
    serve(pair, link, {"a": LONG})
    (error,) = pair.seen["a"].errors
    assert "first dropped chunk: duplicate" in error.message  # its number did not increase
    check_invariants(pair, link, {"a": LONG}, offline)


def test_held_frames_past_the_deadline_never_touch_reused_pages(faulty_pair, offline):
    """A's third chunk (tokens 8..11) and its kv_done are held for 7 later messages; A fails at
    its deadline; B then gets A's very pages (the pool holds one request), and A's late chunk
    reaches D in the middle of B's transfer, just before B's own rows for tokens 8..11, and its
    kv_done right after B's: both dropped as unknown, B's output is the oracle's."""
    pair, link = faulty_pair("chunk#2=delay,done#0=delay,hold=7", d_num_pages=6)
    assert pair.submit("a", LONG, PARAMS, timeout_s=SHORT_S).ok
    a_pages = set(pair.decode.scheduler.get("a").table.pages)
    pair.run_until(lambda: pair.seen["a"].is_over and not pair.prefill.scheduler.requests)
    (error,) = pair.seen["a"].errors
    assert error.stage == "transfer" and "timed out" in error.message
    assert pair.decode_pages_used == 0 and link.senders[0].faults.num_held == 2
    b_prompt = PROMPTS[3]  # 21 tokens: 6 chunks and a kv_done, the 9th to 15th messages
    assert pair.submit("b", b_prompt, PARAMS).ok
    assert set(pair.decode.scheduler.get("b").table.pages) == a_pages
    pair.run_until(lambda: pair.seen["b"].is_over)
    assert link.senders[0].faults.num_held == 0  # both went out during B's transfer
    assert pair.receiver.stats().dropped[DropReason.UNKNOWN_RENDEZVOUS] == 2
    check_invariants(pair, link, {"a": LONG, "b": b_prompt}, offline)


@pytest.mark.parametrize("action", ["drop", "dup", "delay", "corrupt"])
def test_faulted_abort_pages_reclaimed_by_the_deadline_at_worst(faulty_pair, offline, action):
    """The router's Abort reaches only P (mid-prefill), and P's kv_abort is lost, replayed,
    held or corrupted: D frees the pages when it arrives, or else at the reservation's deadline,
    and fails the request either way."""
    pair, link = faulty_pair(f"abort#0={action}", chunk_size=4, max_batch_tokens=4)
    assert pair.submit("a", LONG, PARAMS, timeout_s=SHORT_S).ok
    pair.run_until(lambda: pair.receiver.stats().chunks_written > 0, "a first chunk")
    pair.abort("a", decode=False)
    pair.run_until(lambda: pair.seen["a"].is_over)
    (error,) = pair.seen["a"].errors
    is_lost = action != "dup"  # a held abort has no later message to follow: out after the end
    assert error.stage == "transfer"
    assert ("timed out" if is_lost else "prefill aborted") in error.message
    assert [(r.kind, r.action) for r in link.records] == [("abort", action)]
    check_invariants(pair, link, {"a": LONG}, offline)
    check_serves_after(pair, link, offline)


@pytest.mark.parametrize("kind", ["chunk", "done"])
def test_corrupted_messages_are_never_decoded(faulty_pair, offline, kind):
    """Every chunk (payload or header byte), or every kv_done, has one byte flipped. With seed 0
    one flip lands in r3's first token: before the header checksum that kv_done decoded as a
    valid message, and the decode node generated r3 from the wrong token. Now it is dropped and
    r3 fails at its deadline."""
    pair, link = faulty_pair(f"{kind}.corrupt=1.0,seed=0")
    prompts = {f"r{i}": p for i, p in enumerate(PROMPTS)}
    serve(pair, link, prompts, timeout_s=SHORT_S if kind == "done" else TRANSFER_S)
    outcomes = check_invariants(pair, link, prompts, offline)
    assert set(outcomes.values()) == {"failed"}
    dropped = pair.receiver.stats().dropped
    assert dropped.get(DropReason.BAD_CHECKSUM, 0) + dropped.get(DropReason.MALFORMED, 0) >= 8
    check_serves_after(pair, link, offline)


# ---- (b) end to end: `duet up` 1P1D, faults in the prefill node's process -------------------

E2E_STREAMS = 16
E2E_MAX_NEW = 8
# Each stream sends one chunk and one kv_done (prompts under one prefill chunk): `limit` covers
# exactly the storm, so the requests after it meet a good link.
E2E_PLAN = f"drop=0.1,dup=0.1,delay=0.1,reorder=0.1,corrupt=0.1,seed=7,limit={2 * E2E_STREAMS}"
E2E_TIMEOUTS = {"transfer_s": 4.0, "node_timeout_s": 30.0}
# Each fault costs at most one move, and the plan faults at most `limit` messages: with this
# many moves allowed no stream can run out of them.
E2E_MAX_MIGRATIONS = 2 * E2E_STREAMS
E2E_DTYPE = "float32"  # greedy tokens independent of the batch: comparable with the oracle
# An attempt ends by the KV deadline (transfer_s) after its prefill, and a stream can meet every
# fault of the plan in turn: the bound covers that, and is never the expected time.
E2E_BOUND_S = E2E_TIMEOUTS["transfer_s"] * 2 * E2E_STREAMS + 60.0
PAGES_USED = ("duet_kv_pages_used", {"node": "decode-0", "role": "decode"})


@pytest.fixture(scope="module")
def faulty_cluster(tmp_path_factory):
    raw = cluster_shorthand(1, 1)
    raw["timeouts"] = E2E_TIMEOUTS
    raw.setdefault("router", {})["max_migrations"] = E2E_MAX_MIGRATIONS
    config = tmp_path_factory.mktemp("cfg") / "faults.toml"
    config.write_text(dump_toml(raw))
    up = start_cluster(
        ["--config", str(config), "--dtype", E2E_DTYPE],
        tmp_path_factory,
        env={ENV_VAR: E2E_PLAN},
    )
    yield up
    up.stop()


async def _one_stream(client: openai.AsyncOpenAI, prompt: str):
    """("finished", text, finish_reason) or ("failed", error code, message)."""
    try:
        stream = await client.completions.create(
            model="tiny-model", prompt=prompt, max_tokens=E2E_MAX_NEW, temperature=0, stream=True
        )
        parts, finish = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "finished", "".join(parts), finish
    except openai.APIError as exc:
        return "failed", getattr(exc, "code", None), exc.message


def test_e2e_streams_under_faults_end_and_pages_return(faulty_cluster):
    up = faulty_cluster
    assert "KV FAULT INJECTION IS ON" in up.log()  # the prefill node said so, loudly
    used = lambda: up.metric(PAGES_USED[0], **PAGES_USED[1])  # noqa: E731
    assert _wait(lambda: used() == 0, 10)
    # Four distinct prompts (four oracle runs); greedy output does not depend on the batch.
    prompts = [f"Stream {i % 4}: a river runs through the valley" for i in range(E2E_STREAMS)]

    async def storm():
        client = up.async_client()
        tasks = [_one_stream(client, p) for p in prompts]
        return await asyncio.wait_for(asyncio.gather(*tasks), E2E_BOUND_S)

    results = asyncio.run(storm())  # raises TimeoutError if any client hangs past the bound
    refs = {p: generate_reference(E2E_DTYPE, E2E_MAX_NEW, prompt=p)["text"] for p in set(prompts)}
    for prompt, (outcome, a, b) in zip(prompts, results, strict=True):
        assert outcome == "finished", f"{prompt!r}: {a} {b}"
        assert b in ("stop", "length") and a == refs[prompt], f"{prompt!r}: {a!r}"
    # the faults did fail transfers: those attempts were retried, unseen by the clients
    assert up.metric("duet_request_migrations_total", stage="transfer") > 0
    assert _wait(lambda: used() == 0, 15), "decode pages did not return to the baseline"

    # The storm used up the plan's `limit`: the same nodes now serve on a good link.
    client = up.client()
    for prompt in prompts[:3]:
        out = client.completions.create(
            model="tiny-model", prompt=prompt, max_tokens=E2E_MAX_NEW, temperature=0
        )
        assert out.choices[0].text == refs[prompt]
    assert _wait(lambda: used() == 0, 15)
    health = httpx.get(up.url + "/health", timeout=10).json()
    assert health["status"] == "ok"


def test_e2e_ctrl_c_leaves_no_process_behind(faulty_cluster):
    up = faulty_cluster
    config = re.search(r"config (\S+cluster\.toml)", up.log()).group(1)
    pids = dict(up.child_pids)
    assert len(pids) == 3 and all(map(alive, pids.values()))
    assert up.interrupt() == 0
    assert not [name for name, pid in pids.items() if alive(pid)]
    assert processes_mentioning(config) == []
    assert not alive(up.proc.pid)
