"""What the fault tests share: a cluster's children and their state as the launcher and the
router report them, signals to several processes, and streaming clients in the background."""

from __future__ import annotations

import asyncio
import os
import re
import threading
from pathlib import Path

import httpx
import openai

from deploy.local_cluster import dump_toml
from tests.e2e.e2e_helpers import alive, cluster_shorthand
from tests.e2e.e2e_helpers import wait_until as _wait

MAX_NEW = 24
STREAMS_BOUND_S = 120.0  # every stream ends within this, whatever the fault
# What a dropped connection raises: the openai client wraps errors before the stream starts
# (APIError); a drop mid-stream comes from its HTTP transport as it is (httpx2 in openai >= 3).
DROPPED: tuple[type[BaseException], ...] = (openai.APIError, httpx.HTTPError)
try:
    import httpx2

    DROPPED += (httpx2.HTTPError,)
except ImportError:
    pass


def fault_config(path, num_prefill: int, num_decode: int, timeouts: dict, **router) -> Path:
    """A float32 cluster config on free ports with the test's `timeouts` (and `[router]`
    fields), written to `path`."""
    raw = cluster_shorthand(num_prefill, num_decode)
    raw["router"].update(router)
    raw["dtype"] = "float32"
    raw["timeouts"] = timeouts
    path.write_text(dump_toml(raw))
    return path


def child_pids(up) -> dict[str, int]:
    """The current pid of every child (the launcher logs each start and restart)."""
    return {name: int(pid) for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", up.log())}


def all_ready(up) -> bool:
    body = httpx.get(up.url + "/health", timeout=5).json()
    return body["status"] == "ok" and all(n["status"] == "ready" for n in body["nodes"].values())


def decode_pages_used(up) -> list[float]:
    names = [n for n in child_pids(up) if n.startswith("decode")]
    return [up.metric("duet_kv_pages_used", node=n, role="decode") for n in names]


def dispatched(up, role: str, name: str | None = None) -> float:
    names = [name] if name else [n for n in child_pids(up) if n.startswith(role)]
    return sum(up.metric("duet_node_requests_total", node=n, role=role) for n in names)


def signal_all(pids, sig) -> None:
    for pid in pids:
        os.kill(pid, sig)


class Streams:
    """One streaming completion per prompt in a background thread (its own event loop):
    `first` is set once every stream has its first token; `results` holds, per prompt, the
    text and finish reason, or the exception that ended it."""

    def __init__(self, up, prompts: list[str], max_tokens: int = MAX_NEW, url: str = ""):
        """`url`: the router to send to (`up`'s first by default)."""
        self.up, self.prompts, self.max_tokens = up, prompts, max_tokens
        self.url = url or up.url
        self.num_first = 0
        self.first = threading.Event()
        self.results: dict[str, tuple] = {}
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _one(self, client, prompt: str) -> tuple:
        parts, finish = [], None
        try:
            stream = await client.completions.create(
                model="tiny-model",
                prompt=prompt,
                max_tokens=self.max_tokens,
                temperature=0,
                stream=True,
            )
            async for chunk in stream:
                if not parts:
                    self.num_first += 1
                    if self.num_first == len(self.prompts):
                        self.first.set()
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
        except DROPPED as exc:
            return ("error", exc)
        return ("ok", "".join(parts), finish)

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=STREAMS_BOUND_S
        )
        outs = await asyncio.wait_for(
            asyncio.gather(*(self._one(client, p) for p in self.prompts)), STREAMS_BOUND_S
        )
        self.results = dict(zip(self.prompts, outs, strict=True))

    def join(self) -> dict[str, tuple]:
        self.thread.join(STREAMS_BOUND_S + 10)
        assert not self.thread.is_alive(), "a client hung"
        # Every stream has its outcome (a client error other than a dropped connection would
        # end the thread without any).
        assert len(self.results) == len(self.prompts), "a stream raised: see the warning"
        return self.results


def assert_recovered(up) -> None:
    """The supervisor restarted what died, every node is ready, no KV page is held, and a new
    request is served."""
    assert _wait(lambda: all_ready(up), 120), httpx.get(up.url + "/health", timeout=5).text
    assert all(alive(pid) for pid in child_pids(up).values())
    assert _wait(lambda: all(u == 0 for u in decode_pages_used(up)), 30), decode_pages_used(up)
    out = up.client().completions.create(model="tiny-model", prompt="Hello", max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length")


def assert_all_match(results, references) -> None:
    for prompt, result in results.items():
        assert result[0] == "ok", f"{prompt!r}: {result}"
        assert result[1] == references[prompt], prompt
        assert result[2] in ("stop", "length")
