"""End to end: `duet up --decode-ranks 2` (float32) and the official openai client.

The decode node runs two ranks (data-parallel attention, experts split in halves). Greedy
outputs must equal `duet generate --json` token for token; 32 concurrent streams finish and are
spread over both ranks; killing one rank makes the node fail and restart, and its streams go on
to the end on the restarted node."""

import asyncio
import json
import os
import re
import signal
import threading

import httpx
import pytest
from e2e_helpers import (
    alive,
    cluster_shorthand,
    generate_reference,
    processes_mentioning,
    start_cluster,
)
from e2e_helpers import (
    wait_until as _wait,
)

from deploy.local_cluster import dump_toml

ARGS = ["--prefill", "1", "--decode", "1", "--decode-ranks", "2", "--dtype", "float32"]
MAX_NEW = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    up = start_cluster(ARGS, tmp_path_factory)
    yield up
    up.stop()


def _rank_pids(up) -> list[int]:
    config = re.search(r"config (\S+cluster\.toml)", up.log()).group(1)
    return [pid for pid in processes_mentioning(config) if "decode_node.ranks" in _cmdline(pid)]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.parametrize("prompt", ["Hello world", "The quick brown fox"])
def test_greedy_matches_duet_generate(cluster, prompt):
    want = generate_reference("float32", MAX_NEW, prompt=prompt)
    got = cluster.client().completions.create(
        model="tiny-model", prompt=prompt, max_tokens=MAX_NEW, temperature=0
    )
    assert got.choices[0].text == want["text"]


def test_32_concurrent_streams_finish_on_both_ranks(cluster):
    prompts = [f"Request {i % 4}: tell me about the river" for i in range(32)]

    async def one(c, prompt):
        stream = await c.completions.create(
            model="tiny-model", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True
        )
        parts, finish = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def run_all():
        c = cluster.async_client()
        return await asyncio.wait_for(asyncio.gather(*(one(c, p) for p in prompts)), 180)

    results = asyncio.run(run_all())
    assert all(finish in ("stop", "length") for _, finish in results)
    for i in range(4):  # greedy: the same prompt gives the same text on either rank
        want = generate_reference("float32", MAX_NEW, prompt=prompts[i])["text"]
        assert {results[j][0] for j in range(i, 32, 4)} == {want}


def test_ctrl_c_stops_every_rank(cluster):
    ranks = _rank_pids(cluster)
    assert len(ranks) == 1 and alive(ranks[0])
    assert cluster.interrupt() == 0
    assert not alive(ranks[0])
    served = dict(re.findall(r"rank (\d): (\d+) requests reserved here", cluster.log()))
    assert int(served["0"]) > 0 and int(served["1"]) > 0, served  # DP: both ranks got requests


def _dispatched(up) -> float:
    return up.metric("duet_node_requests_total", node="prefill-0", role="prefill")


def _streams(up, prompts: list[str], max_tokens: int, firsts: list | None = None):
    """Streams the prompts concurrently in a thread: (thread, results) where results fills with
    (text, finish_reason) or ("error", line) per prompt once the thread ends; `firsts` gets the
    prompt of each stream as its first chunk arrives."""
    results: list = []

    async def one(c, prompt):
        parts, finish = [], None
        async with c.stream(
            "POST",
            up.url + "/v1/completions",
            json={
                "model": "tiny-model",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
            },
        ) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "error", event["error"]["message"]
                if not parts and firsts is not None:
                    firsts.append(prompt)
                parts.append(event["choices"][0]["text"])
                finish = event["choices"][0]["finish_reason"] or finish
        return "".join(parts), finish

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            results.extend(
                await asyncio.wait_for(asyncio.gather(*(one(c, p) for p in prompts)), 150)
            )

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    thread.start()
    return thread, results


def test_killing_a_rank_restarts_the_node_and_its_requests_move(tmp_path_factory):
    """One rank of the only decode node is SIGKILLed while 8 streams sit on the node, none past
    its first token (both ranks frozen once all 8 are reserved): the node reports failure,
    the launcher restarts it, and every stream goes on on the restarted node (the router holds
    the moved requests until it is back) with exactly `duet generate`'s greedy text."""
    path = tmp_path_factory.mktemp("cfg") / "ranks.toml"
    raw = cluster_shorthand(1, 1)
    raw["dtype"] = "float32"
    raw["decode"][0]["ranks"] = 2
    raw["timeouts"] = {"reserve_s": 90.0, "heartbeat_s": 0.25, "node_timeout_s": 5.0}
    path.write_text(dump_toml(raw))
    up = start_cluster(["--config", str(path)], tmp_path_factory)
    prompts = [f"Hi {i}" for i in range(8)]
    refs = {p: generate_reference("float32", MAX_NEW, prompt=p)["text"] for p in prompts}
    try:
        prefill = up.child_pids["prefill-0"]
        # First contact of the prefill node with each rank's KV receiver, while all are awake:
        # with the prefill node frozen, rank 0 spreads the two reservations over both ranks.
        os.kill(prefill, signal.SIGSTOP)
        try:
            thread, results = _streams(up, prompts[:2], 2)
            assert _wait(lambda: _dispatched(up) == 2, 30)
        finally:
            os.kill(prefill, signal.SIGCONT)
        thread.join(60)
        assert all(finish == "length" for _, finish in results), results
        ranks = [up.child_pids["decode-0"], *_rank_pids(up)]
        os.kill(prefill, signal.SIGSTOP)
        frozen = [prefill]
        try:
            firsts: list = []
            thread, results = _streams(up, prompts, MAX_NEW, firsts)
            assert _wait(lambda: _dispatched(up) == 2 + len(prompts), 30)
            for pid in ranks:  # every reservation is made: freeze the decode node
                os.kill(pid, signal.SIGSTOP)
            frozen += ranks
            os.kill(prefill, signal.SIGCONT)  # the first tokens go out, nothing more
            frozen.remove(prefill)
            # every stream has its first token: the requests are at their decode stage
            assert _wait(lambda: len(firsts) == len(prompts), 30), firsts
            os.kill(ranks[1], signal.SIGKILL)
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        thread.join(160)
        assert not thread.is_alive(), "a stream hung"
        for prompt, (text, finish) in zip(prompts, results, strict=True):
            assert (text, finish) == (refs[prompt], "length"), prompt
        log = up.log()
        assert "node decode-0 (decode) failed" in log or "decode-0 (decode) closed" in log
        assert "restarted decode-0" in log
        assert up.metric("duet_request_migrations_total", stage="decode") >= 1
    finally:
        up.stop()
