"""End to end: `duet up` (1P1D in bfloat16, 2P1D in float32) and the official openai client.

The oracle for outputs is `duet generate --json` with the same dtype: greedy outputs must be
identical token for token. The last test of each cluster presses Ctrl-C and checks that no
process of the cluster is left."""

import asyncio
import re
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from e2e_helpers import (
    alive,
    free_port,
    free_port_pair,
    generate_reference,
    processes_mentioning,
    start_cluster,
)

from deploy.local_cluster import dump_toml
from engine.tiny_model import ensure_tiny_model
from engine.tokenizer import Tokenizer

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

CLUSTERS = ["1p1d", "2p1d"]  # 1P1D: the shorthand, bfloat16; 2P1D: a config file, float32
LONG_PROMPT = " ".join(
    ["The prefill node is compute bound; the decode node is memory bound."] * 11
)  # 309 tokens: more than one prefill chunk (256)
PROMPTS = ["Hello world", "The quick brown fox", "日本語のテキスト 🚀", LONG_PROMPT]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to five."}],
]
MAX_NEW = 16
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _2p1d_config(path):
    """deploy/configs/2p1d.toml (prefill `replicas = 2`) moved to free loopback ports."""
    raw = tomllib.loads((DEPLOY / "configs" / "2p1d.toml").read_text())
    raw["router"]["control_port"] = free_port()
    raw["prefill"][0]["control_port"] = free_port_pair()
    raw["decode"][0].update(name="decode-0", control_port=free_port(), kv_port=free_port())
    path.write_text(dump_toml(raw))
    return path


@pytest.fixture(scope="module", params=CLUSTERS)
def cluster(request, tmp_path_factory):
    if request.param == "1p1d":
        dtype, args = "bfloat16", ["--prefill", "1", "--decode", "1", "--dtype", "bfloat16"]
    else:
        config = _2p1d_config(tmp_path_factory.mktemp("cfg") / "2p1d.toml")
        dtype, args = "float32", ["--config", str(config), "--dtype", "float32"]
    up = start_cluster(args, tmp_path_factory)
    up.dtype = dtype
    up.name = request.param
    yield up
    up.stop()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(ensure_tiny_model())


def _stream_text(stream, chat: bool):
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        parts.append((choice.delta.content if chat else choice.text) or "")
        finish = choice.finish_reason or finish
    return "".join(parts), finish, usage


def test_models_and_health(cluster):
    assert [m.id for m in cluster.client().models.list().data] == ["tiny-model"]
    health = httpx.get(cluster.url + "/health", timeout=10).json()
    roles = sorted(n["role"] for n in health["nodes"].values())
    assert health["status"] == "ok"
    assert roles == (
        ["decode", "prefill"] if cluster.name == "1p1d" else ["decode", "prefill", "prefill"]
    )


@pytest.mark.parametrize("prompt", PROMPTS, ids=["hello", "fox", "unicode", "long"])
def test_greedy_completions_match_duet_generate(cluster, prompt):
    ref = generate_reference(cluster.dtype, MAX_NEW, prompt=prompt)
    c = cluster.client()
    out = c.completions.create(model="tiny-model", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
    assert out.choices[0].text == ref["text"]
    assert out.usage.completion_tokens == len(ref["token_ids"])
    stream = c.completions.create(
        model="tiny-model", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    text, finish, usage = _stream_text(stream, chat=False)
    assert text == ref["text"] and finish in ("stop", "length")
    assert usage.completion_tokens == len(ref["token_ids"])


@pytest.mark.parametrize("messages", CHATS, ids=["one-turn", "system"])
def test_greedy_chat_matches_duet_generate(cluster, tok, messages):
    ref = generate_reference(cluster.dtype, MAX_NEW, prompt_ids=tok.encode_chat(messages))
    c = cluster.client()
    out = c.chat.completions.create(
        model="tiny-model", messages=messages, max_tokens=MAX_NEW, temperature=0
    )
    assert out.choices[0].message.content == ref["text"]
    assert out.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(
        model="tiny-model", messages=messages, max_tokens=MAX_NEW, temperature=0, stream=True
    )
    text, finish, _ = _stream_text(stream, chat=True)
    assert text == ref["text"] and finish in ("stop", "length")


def test_seeded_sampling_matches_duet_generate(cluster):
    sampling = ("--temperature", "0.9", "--top-k", "40", "--seed", "1234")
    ref = generate_reference(cluster.dtype, 12, prompt="Once upon a time", extra=sampling)
    out = cluster.client().completions.create(
        model="tiny-model", prompt="Once upon a time", max_tokens=12, temperature=0.9,
        seed=1234, extra_body={"top_k": 40},
    )  # fmt: skip
    assert out.choices[0].text == ref["text"]


def test_64_concurrent_streams_all_finish(cluster):
    prompts = [f"Request {i % 8}: tell me about the river" for i in range(64)]

    async def one(c, prompt):
        stream = await c.completions.create(
            model="tiny-model", prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        parts, finish = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def run_all():
        c = cluster.async_client()
        return await asyncio.wait_for(asyncio.gather(*(one(c, p) for p in prompts)), 240)

    before = {n: cluster.metric("duet_node_requests_total", node=n, role="prefill")
              for n in ("prefill-0", "prefill-1")}  # fmt: skip
    results = asyncio.run(run_all())
    assert all(finish in ("stop", "length") for _, finish in results)
    # greedy: the same prompt gives the same text whatever it was batched with
    for i in range(8):
        assert len({results[j][0] for j in range(i, 64, 8)}) == 1
    served = {n: cluster.metric("duet_node_requests_total", node=n, role="prefill") - before[n]
              for n in before}  # fmt: skip
    if cluster.name == "2p1d":
        assert served["prefill-0"] > 0 and served["prefill-1"] > 0
        assert served["prefill-0"] + served["prefill-1"] == 64
    else:
        assert served["prefill-0"] == 64
    assert cluster.metric("duet_ttft_seconds_count") >= 64


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_disconnect_mid_stream_returns_decode_pages(cluster):
    """8 long streams (8 x 480 tokens take seconds to decode) are dropped after their first
    event: the decode node's used pages must be back at their earlier count well before the
    requests could have finished on their own."""
    used = lambda: cluster.metric("duet_kv_pages_used", node="decode-0", role="decode")  # noqa: E731
    assert _wait(lambda: used() == 0, 10), "pages still in use before the test"
    baseline = used()
    aborted_before = cluster.metric("duet_requests_total", outcome="aborted")
    body = {"model": "tiny-model", "prompt": "Hi", "max_tokens": 480, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    num_streams = 8
    started, close = threading.Barrier(num_streams + 1, timeout=60), threading.Event()

    def stream_then_drop():
        with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # kept referenced: a collected iterator closes the stream
            next(lines)
            started.wait()
            close.wait(timeout=60)
        # leaving the block closes the connection mid-stream

    threads = [threading.Thread(target=stream_then_drop) for _ in range(num_streams)]
    for t in threads:
        t.start()
    started.wait()
    assert _wait(lambda: used() > baseline, 5), "the streams never showed up in decode pages"
    close.set()
    closed_at = time.monotonic()
    for t in threads:
        t.join(timeout=10)
    assert _wait(lambda: used() == baseline, 10)
    freed_after = time.monotonic() - closed_at
    assert cluster.metric("duet_requests_total", outcome="aborted") == aborted_before + num_streams
    # finishing on their own would take several more seconds: the pages came back by the abort
    assert freed_after < 3.0, f"pages came back only {freed_after:.1f} s after the disconnect"


def test_bad_requests(cluster):
    c = cluster.client()
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny-model", prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model="tiny-model", prompt="word " * 700, max_tokens=4)
    r = httpx.post(cluster.url + "/v1/completions", content=b"{", timeout=10)
    assert r.status_code == 400 and "error" in r.json()


def test_ctrl_c_leaves_no_process_behind(cluster):
    config = re.search(r"config (\S+cluster\.toml)", cluster.log()).group(1)
    pids = dict(cluster.child_pids)
    assert len(pids) == (3 if cluster.name == "1p1d" else 4) and all(map(alive, pids.values()))
    assert cluster.interrupt() == 0
    assert not [name for name, pid in pids.items() if alive(pid)]
    assert processes_mentioning(config) == []
    assert not alive(cluster.proc.pid)
