"""End to end: `duet up --decode-ranks 2` (float32) and the official openai client.

The decode node runs two ranks (data-parallel attention, experts split in halves). Greedy
outputs must equal `duet generate --json` token for token; 32 concurrent streams finish and are
spread over both ranks; killing one rank makes the node report failure and every stream end with
an error within a few seconds."""

import asyncio
import os
import re
import signal
import time

import httpx
import pytest
from e2e_helpers import alive, generate_reference, processes_mentioning, start_cluster

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


def test_killing_a_rank_fails_the_node_and_its_requests(tmp_path_factory):
    up = start_cluster(ARGS, tmp_path_factory)
    try:
        body = {"model": "tiny-model", "prompt": "Hi", "max_tokens": 400, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip

        async def one(i):
            error = ""
            async with httpx.AsyncClient(timeout=60) as c:
                async with c.stream("POST", up.url + "/v1/completions",
                                    json={**body, "prompt": f"Hi {i}"}) as r:  # fmt: skip
                    async for line in r.aiter_lines():
                        error = line if '"error"' in line else error
            return error, time.monotonic()

        async def run():
            tasks = [asyncio.create_task(one(i)) for i in range(8)]
            await asyncio.sleep(1.5)  # every stream decoding (400 tokens take far longer)
            (rank1,) = _rank_pids(up)
            killed = time.monotonic()
            os.kill(rank1, signal.SIGKILL)
            return killed, await asyncio.wait_for(asyncio.gather(*tasks), 60)

        killed, results = asyncio.run(run())
        for error, ended in results:  # the SSE error event, then [DONE]
            assert "failed" in error, error
            assert ended - killed < 10.0
        assert "node decode-0 (decode) failed" in up.log()
    finally:
        up.stop()
