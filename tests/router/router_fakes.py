"""Fake prefill/decode nodes that speak the real control protocol over ZeroMQ (no model), and
a helper that runs the real router app under uvicorn in a thread.

`FakeCluster` plays every node of a cluster config in one thread. Its output for a request is
`script` (P's FirstToken is script[0]; D streams the rest one token per `token_interval_s`),
stopping like a real decode node: EOS / stop_token_ids ("stop"), max_new_tokens ("length").
Knobs (set from the test thread): `refuse` (decode nodes that refuse reservations), `silent`
(nodes that stop answering and heartbeating), `tokens_before_first` (D's first tokens are sent
before P's FirstToken), `fail_stages` ("prefill" / "decode": every request gets a RequestError
there).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
import uvicorn
import zmq

from control import protocol
from control.cluster_config import ClusterConfig
from control.protocol import (
    Abort,
    FirstToken,
    Heartbeat,
    NodeReady,
    Prefill,
    RequestError,
    RequestTokens,
    Reserve,
    ReserveReply,
    RouterPing,
    StepTokens,
)
from deploy.local_cluster import free_ports

FAKE_FINGERPRINT = None  # the fakes send none, so the router's check is skipped


def fake_config(num_prefill: int = 1, num_decode: int = 1, sla=None, **router) -> ClusterConfig:
    """A cluster on free loopback ports with short timeouts (fast failure tests); `sla`: extra
    [sla] fields (admission tests). A request no decode node has room for is refused at once
    (`queue_timeout_s = 0`) unless the test asks for the wait in turn."""
    ports = iter(free_ports(2 + num_prefill + 2 * num_decode))
    free_port = ports.__next__
    raw = {
        "sla": {"ttft_ms": 1000, "tpot_ms": 200, "queue_timeout_s": 0, **(sla or {})},
        "router": {"port": free_port(), "control_port": free_port(), **router},
        "timeouts": {
            "reserve_s": 1.0, "prefill_queue_s": 5.0, "transfer_s": 5.0, "decode_s": 30.0,
            "heartbeat_s": 0.1, "node_timeout_s": 0.8,
        },
        "prefill": [{"name": f"p{i}", "control_port": free_port()} for i in range(num_prefill)],
        "decode": [
            {"name": f"d{i}", "control_port": free_port(), "kv_port": free_port(), "num_pages": 64,
             "page_size": 16}
            for i in range(num_decode)
        ],
    }  # fmt: skip
    return ClusterConfig.from_dict(raw)


@dataclass
class _Running:
    node: str
    sampling: dict
    prompt_len: int
    num_sent: int = 1  # the first token came from P
    next_at: float = 0.0


@dataclass(eq=False)
class FakeCluster(threading.Thread):
    cfg: ClusterConfig
    script: list[int]
    eos_id: int
    token_interval_s: float = 0.005
    prefill_delay_s: float = 0.0
    refuse: set[str] = field(default_factory=set)
    silent: set[str] = field(default_factory=set)
    tokens_before_first: bool = False
    fail_stages: set[str] = field(default_factory=set)
    router_replica: int = 0  # the router the fake nodes report to ([router] replicas)

    def __post_init__(self):
        threading.Thread.__init__(self, daemon=True)
        self.ctx = zmq.Context()
        self.pulls: dict[str, zmq.Socket] = {}
        self.push: dict[str, zmq.Socket] = {}
        self.kv_endpoint = {d.name: d.kv_endpoint for d in self.cfg.decode}
        self.total_pages = {d.name: d.num_pages for d in self.cfg.decode}
        self.page_size = {d.name: d.page_size for d in self.cfg.decode}
        self.reserved: dict[str, dict[str, int]] = {d.name: {} for d in self.cfg.decode}
        self.reserve_sampling: dict[str, dict] = {}
        self.fork_ids: dict[str, list[str]] = {}  # n > 1: each request's forks (Reserve)
        self.prefills: list[tuple[float, str, Prefill]] = []  # (due, node, msg)
        self.running: dict[str, _Running] = {}
        self.aborts: list[tuple[str, str]] = []  # (node, request_id)
        self.prefill_count: dict[str, int] = {p.name: 0 for p in self.cfg.prefill}
        self._halt = threading.Event()

    # ---- plumbing --------------------------------------------------------------------------
    def run(self) -> None:
        for node in (*self.cfg.prefill, *self.cfg.decode):
            pull = self.ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            pull.bind(node.control_endpoint)
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(self.cfg.router.for_replica(self.router_replica).control_endpoint)
            self.pulls[node.name], self.push[node.name] = pull, push
        poller = zmq.Poller()
        by_socket = {}
        for name, pull in self.pulls.items():
            poller.register(pull, zmq.POLLIN)
            by_socket[pull] = name
        for node in self.cfg.prefill:
            self._send(node.name, NodeReady(node.name, "prefill", {"dtype": "bfloat16"}))
        for node in self.cfg.decode:
            info = {"kv_endpoint": node.kv_endpoint, "num_pages": node.num_pages,
                    "page_size": node.page_size}  # fmt: skip
            self._send(node.name, NodeReady(node.name, "decode", info))
        next_hb = 0.0
        while not self._halt.is_set():
            for sock, _ in poller.poll(timeout=2):
                name = by_socket[sock]
                msg = protocol.decode(sock.recv())
                if name not in self.silent:
                    self._handle(name, msg)
            now = time.monotonic()
            self._tick_prefill(now)
            self._tick_decode(now)
            if now >= next_hb:
                self._heartbeats()
                next_hb = now + self.cfg.timeouts.heartbeat_s
        for sock in (*self.pulls.values(), *self.push.values()):
            sock.close(linger=0)
        self.ctx.term()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def _send(self, node: str, msg) -> None:
        if node not in self.silent:
            self.push[node].send(protocol.encode(msg))

    def _role(self, node: str) -> str:
        return "prefill" if node in self.prefill_count else "decode"

    # ---- behaviour -------------------------------------------------------------------------
    def _handle(self, node: str, msg) -> None:
        if isinstance(msg, Reserve):
            num_tokens = msg.prompt_len + msg.sampling["max_new_tokens"]
            pages = -(-num_tokens // self.page_size[node]) * (1 + len(msg.fork_ids))
            free = self.total_pages[node] - sum(self.reserved[node].values())
            if node in self.refuse or pages > free:
                self._send(node, ReserveReply(msg.request_id, False, reason="no free KV pages"))
                return
            self.reserved[node][msg.request_id] = pages
            self.reserve_sampling[msg.request_id] = msg.sampling
            self.fork_ids[msg.request_id] = list(msg.fork_ids)
            self._send(node, ReserveReply(msg.request_id, True, self.kv_endpoint[node]))
        elif isinstance(msg, Prefill):
            self.prefill_count[node] += 1
            self.prefills.append((time.monotonic() + self.prefill_delay_s, node, msg))
        elif isinstance(msg, Abort):
            self.aborts.append((node, msg.request_id))
            self.prefills = [p for p in self.prefills if p[2].request_id != msg.request_id]
            if node in self.reserved:
                self.reserved[node].pop(msg.request_id, None)
                run = self.running.get(msg.request_id)
                if run is not None and run.node == node:
                    del self.running[msg.request_id]

    def _decode_node_of(self, request_id: str) -> str | None:
        for name, held in self.reserved.items():
            if request_id in held:
                return name
        return None

    def _tick_prefill(self, now: float) -> None:
        due = [p for p in self.prefills if p[0] <= now]
        self.prefills = [p for p in self.prefills if p[0] > now]
        for _, node, msg in due:
            decode = self._decode_node_of(msg.request_id)
            if "prefill" in self.fail_stages or decode is None:
                self._send(node, RequestError(msg.request_id, "prefill", "fake prefill failure"))
                continue
            run = _Running(decode, msg.sampling, len(msg.token_ids), next_at=now)
            first = self.script[0]
            forks = self.fork_ids.pop(msg.request_id, [])
            for fork in forks:  # n > 1: each fork decodes as a request of its own (the same
                # script), its pages counted with the request's
                self.reserved[decode][fork] = 0
                self.running[fork] = _Running(decode, msg.sampling, len(msg.token_ids), next_at=now)
            if self.tokens_before_first:
                self.running[msg.request_id] = run
                self._tick_decode(now, only=msg.request_id)
            self._send(node, _first_token(msg, first, len(forks)))
            if not self.tokens_before_first:
                self.running[msg.request_id] = run

    def _finish_of(self, run: _Running, token: int) -> str | None:
        stop_ids = set(run.sampling["stop_token_ids"])
        if not run.sampling["ignore_eos"]:
            stop_ids.add(self.eos_id)
        if token in stop_ids:
            return "stop"
        if run.num_sent >= run.sampling["max_new_tokens"]:
            return "length"
        return None

    def _tick_decode(self, now: float, only: str | None = None) -> None:
        steps: dict[str, list[RequestTokens]] = {}  # a decode node's tick: one StepTokens
        for rid, run in list(self.running.items()):
            if (only is not None and rid != only) or run.next_at > now or run.node in self.silent:
                continue
            if "decode" in self.fail_stages:
                self._send(run.node, RequestError(rid, "decode", "fake decode failure"))
                self._end(rid, run)
                continue
            step = steps.setdefault(run.node, [])
            last = self.script[(run.num_sent - 1) % len(self.script)]
            if run.num_sent == 1 and self._finish_of(run, last):  # P's token ended it
                step.append(RequestTokens(rid, [], self._finish_of(run, last)))
                self._end(rid, run)
                continue
            token = self.script[run.num_sent % len(self.script)]
            run.num_sent += 1
            finish = self._finish_of(run, token)
            step.append(RequestTokens(rid, [token], finish, **_tokens_logprobs(run, token)))
            run.next_at = now + self.token_interval_s
            if finish:
                self._end(rid, run)
        for node, outputs in steps.items():
            self._send(node, StepTokens.of(outputs))

    def _end(self, rid: str, run: _Running) -> None:
        self.running.pop(rid, None)
        self.reserved[run.node].pop(rid, None)

    def _heartbeats(self) -> None:
        for node in self.cfg.prefill:
            queued = sum(len(p[2].token_ids) for p in self.prefills if p[1] == node.name)
            self._send(node.name, Heartbeat(node.name, "prefill", queued_tokens=queued))
        for node in self.cfg.decode:
            used = sum(self.reserved[node.name].values())
            self._send(
                node.name,
                Heartbeat(
                    node.name,
                    "decode",
                    num_running=len(self.running),
                    free_pages=node.num_pages - used,
                    total_pages=node.num_pages,
                    page_size=node.page_size,
                ),
            )

    def used_pages(self, node: str) -> int:
        return sum(self.reserved[node].values())


class RecordingCluster(FakeCluster):
    """Keeps every Reserve and Prefill it was sent (`messages`), and the RouterPings apart
    (`pings`)."""

    def __post_init__(self):
        super().__post_init__()
        self.messages: list = []
        self.pings: list[RouterPing] = []

    def _handle(self, node, msg):
        if isinstance(msg, (Reserve, Prefill)):
            self.messages.append(msg)
        elif isinstance(msg, RouterPing):
            self.pings.append(msg)
        super()._handle(node, msg)

    def sent(self, kind: type) -> list:
        return [m for m in self.messages if isinstance(m, kind)]


class RouterServer:
    """The real router app (router.__main__.build_app) under uvicorn in a background thread."""

    def __init__(self, cfg: ClusterConfig, model_dir: str, replica: int = 0):
        from router.__main__ import build_app

        app, (host, port) = build_app(cfg, model_dir, replica=replica)
        self.url = f"http://{host}:{port}"
        self.app = app
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                log_level="warning",
                lifespan="on",
                timeout_graceful_shutdown=2,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def router(self):
        return self.app.state.router

    def start(self, timeout_s: float = 20.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"the router at {self.url} did not become healthy in {timeout_s} s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def fake_logprobs(token: int, k: int) -> tuple[float, list[int], list[float]]:
    """What the fakes send as a token's logprobs: -0.25, then tokens token..token+k-1 at
    -0.25, -1.25, ... (the chosen token first)."""
    return -0.25, [(token + j) % 256 for j in range(k)], [-0.25 - j for j in range(k)]


def fake_rank(token: int) -> int:
    """The rank the fakes send for a prompt token: any value, known to the tests."""
    return 1 + token % 7


def _first_token(msg: Prefill, token: int, num_forks: int = 0) -> FirstToken:
    k, prompt_k = msg.sampling.get("logprobs"), msg.sampling.get("prompt_logprobs")
    extra: dict = {"fork_tokens": [token] * num_forks}
    if k is not None:
        lp, ids, lps = fake_logprobs(token, k)
        extra.update(logprob=[lp], top_ids=ids, top_logprobs=lps)
        extra.update(
            fork_logprobs=[lp] * num_forks,
            fork_top_ids=[ids] * num_forks,
            fork_top_logprobs=[lps] * num_forks,
        )
    if prompt_k is not None:
        entries = [fake_logprobs(t, prompt_k) for t in msg.token_ids[1:]]
        extra.update(
            prompt_logprobs=[e[0] for e in entries],
            prompt_top_ids=[e[1] for e in entries],
            prompt_top_logprobs=[e[2] for e in entries],
            prompt_ranks=[fake_rank(t) for t in msg.token_ids[1:]],
        )
    return FirstToken(msg.request_id, token, len(msg.token_ids), {"queue": 1.0}, **extra)


def tokens(request_id: str, token_ids: list[int], finish_reason: str | None = None, **lps):
    """The StepTokens of a decode step that ran this one request (`lps`: its logprobs)."""
    return StepTokens.of([RequestTokens(request_id, token_ids, finish_reason, **lps)])


def _tokens_logprobs(run: _Running, token: int) -> dict:
    k = run.sampling.get("logprobs")
    if k is None:
        return {}
    lp, ids, lps = fake_logprobs(token, k)
    return {"logprobs": [lp], "top_ids": [ids], "top_logprobs": [lps]}


def start_cluster(
    cfg: ClusterConfig, script_ids: list[int], eos_id: int, model_dir, started, cluster_cls=None
) -> tuple[FakeCluster, RouterServer]:
    """Starts fake nodes (`cluster_cls`, FakeCluster by default) and a real router over them;
    both are appended to `started` for `stop_all` at the test's end."""
    fakes = (cluster_cls or FakeCluster)(cfg, script_ids, eos_id=eos_id)
    fakes.start()
    server = RouterServer(cfg, model_dir)
    started.append((fakes, server))
    server.start()
    return fakes, server


def stop_all(started) -> None:
    for fakes, server in started:
        server.stop()
        fakes.stop()


def wait_for(cond, timeout_s: float = 5.0) -> bool:
    """Polls an in-process condition (the router and the fakes run in threads of this process)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return bool(cond())


def assert_invalid_value(cluster, path: str, fields: dict, param: str, message: str) -> None:
    """`fields` on a minimal body of `path` is a 400 invalid_value naming `param`, with
    `message` in its text, refused before any node heard of it. `cluster`: (fakes, server)."""
    fakes, server = cluster
    fakes.messages.clear()
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user"}]}
    r = httpx.post(server.url + path, json={**body, **fields}, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert error["code"] == "invalid_value" and error["type"] == "invalid_request_error"
    assert fakes.messages == []
