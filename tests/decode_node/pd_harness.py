"""A prefill node and a decode node wired in-process: queues for the control plane, the in-process
kvtransfer for KV. `Pair` plays the router: it reserves, sends prefills and aborts, and steps
both loops on the test's thread (deterministic: no sockets; D's overlapped step hands its
side work to a helper thread, but joins it before the step returns)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from control.cluster_config import DecodeNodeConfig, PrefillNodeConfig, TimeoutConfig
from control.messaging import QueueInbox, QueueOutbox
from control.protocol import (
    Abort,
    FirstToken,
    Heartbeat,
    KVEvents,
    NodeReady,
    Preempted,
    Prefill,
    RequestError,
    Reserve,
    ReserveReply,
    StepTokens,
    sampling_to_dict,
)
from control.sampling_params import SamplingParams
from decode_node.node import DecodeNode
from kvtransfer import InprocReceiver, InprocSender, make_fingerprint
from prefill_node.node import PrefillNode

TIMEOUT = 60.0  # upper bound of any loop here; they normally take well under a second


@dataclass
class Seen:
    """What the router saw of one request."""

    first_token: int | None = None
    token_ids: list[int] = field(default_factory=list)  # after the first token
    finish_reason: str | None = None
    errors: list[RequestError] = field(default_factory=list)
    first: FirstToken | None = None  # P's message, with its logprobs
    logprobs: list[float] = field(default_factory=list)  # D's, one per token after the first
    top_ids: list[list[int]] = field(default_factory=list)
    preempted: Preempted | None = None  # D dropped it (on-demand KV ran out)

    @property
    def output(self) -> list[int]:
        """The whole output, as OfflineGenerator returns it."""
        return [self.first_token, *self.token_ids]

    @property
    def is_over(self) -> bool:
        return self.finish_reason is not None or bool(self.errors) or self.preempted is not None


class Pair:
    def __init__(
        self,
        model,
        *,
        p_page_size=3,
        d_page_size=5,
        chunk_size=4,
        max_batch_tokens=8,
        d_num_pages=64,
        max_batch=3,
        timeouts=None,
        sender_factory=InprocSender,
        kv_reservation="on_demand",
        kv_headroom_tokens=32,
        prefix_cache=True,
        sla=None,
        mtp_tokens=0,
        overlap=False,
        d_prefix_cache=False,
        p_num_pages=4096,
        disk_cache_dir="",
    ):
        """`mtp_tokens` > 0: D speculates with the model's MTP layer (which must be loaded).
        `overlap`: while D's forward runs, a helper thread emits the last step's tokens and
        takes in D's inputs (`decode_node.step_overlap`); the outcome is the same as without,
        the tokens going out one step later."""
        self.model = model
        self.timeouts = timeouts or TimeoutConfig(heartbeat_s=0.05)
        cfg = model.cfg
        fp = make_fingerprint(cfg.fingerprint(), model.num_kv_layers, cfg.kv_row_width, model.dtype)
        self.receiver = InprocReceiver(model.new_kv_pool(d_num_pages, d_page_size), fp)
        self.p_in, self.p_out = QueueInbox(), QueueOutbox()
        self.d_in, self.d_out = QueueInbox(), QueueOutbox()
        p_cfg = PrefillNodeConfig(
            "p",
            page_size=p_page_size,
            chunk_size=chunk_size,
            max_batch_tokens=max_batch_tokens,
            prefix_cache=prefix_cache,
            num_pages=p_num_pages,
            disk_cache_dir=str(disk_cache_dir),
        )
        d_cfg = DecodeNodeConfig(
            "d",
            page_size=d_page_size,
            max_batch=max_batch,
            kv_reservation=kv_reservation,
            kv_headroom_tokens=kv_headroom_tokens,
            mtp=mtp_tokens > 0,
            mtp_tokens=max(1, mtp_tokens),
            overlap=overlap,
            prefix_cache=d_prefix_cache,
        )
        self.prefill = PrefillNode(
            "p", model, p_cfg, self.timeouts, self.p_in, self.p_out, sender_factory
        )
        self.decode = DecodeNode(
            "d", model, d_cfg, self.timeouts, self.d_in, self.d_out, self.receiver, sla
        )
        self.seen: dict[str, Seen] = {}
        self.forks: dict[str, list[str]] = {}  # n > 1: the fork ids of each request
        self.heartbeats: list[Heartbeat] = []
        self.steps: list[StepTokens] = []  # every StepTokens D sent, in order
        self.kv_events: list[KVEvents] = []  # both nodes', in the order they were taken
        self.readies: list[NodeReady] = []  # both nodes' (a router restarted: they start over)
        self._rooms = iter(range(1000, 10**6))

    # ---- the router's moves ------------------------------------------------------------------
    def reserve(self, rid: str, prompt_len: int, params: SamplingParams, timeout_s=5.0, prompt=()):
        """`prompt`: its ids, sent as the router sends them (when the sampling reads them, or
        D caches prompts). n > 1: the forks are named `<rid>/<i>`, as the router names them."""
        room = next(self._rooms)
        sends_ids = params.uses_prompt or self.decode.prefix_cache is not None
        prompt_ids = list(prompt) if sends_ids else []
        sampling = sampling_to_dict(params)
        fork_ids = [f"{rid}/{i}" for i in range(1, params.n)]
        self.d_in.put(
            Reserve(rid, room, prompt_len, sampling, timeout_s, prompt_ids, fork_ids=fork_ids)
        )
        self.decode.step()
        (reply,) = self.d_out.take(ReserveReply)
        self.seen.setdefault(rid, Seen())
        if reply.ok:
            self.forks[rid] = fork_ids
            for fork_id in fork_ids:
                self.seen.setdefault(fork_id, Seen())
        return reply, room

    def submit(
        self, rid: str, prompt: list[int], params: SamplingParams, timeout_s=5.0
    ) -> ReserveReply:
        """Reserve on D (KV due within `timeout_s`), then (if admitted) prefill on P, as the
        router does."""
        reply, room = self.reserve(rid, len(prompt), params, timeout_s, prompt)
        if reply.ok:
            sampling = sampling_to_dict(params)
            skip = reply.cached_rows
            self.p_in.put(
                Prefill(rid, room, prompt, sampling, reply.kv_endpoint, 5.0, skip_rows=skip)
            )
        return reply

    def prefill_only(self, rid: str, room: int, prompt, params, endpoint=None) -> None:
        endpoint = endpoint or self.receiver.endpoint
        self.seen.setdefault(rid, Seen())
        self.p_in.put(Prefill(rid, room, prompt, sampling_to_dict(params), endpoint, 5.0))

    def abort(self, rid: str, prefill=True, decode=True) -> None:
        if prefill:
            self.p_in.put(Abort(rid, "test"))
        if decode:
            self.d_in.put(Abort(rid, "test"))

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> None:
        self.prefill.step()
        self.decode.step()
        self.collect()

    def collect(self) -> None:
        for msg in self.p_out.take() + self.d_out.take():
            if isinstance(msg, Heartbeat):
                self.heartbeats.append(msg)
            elif isinstance(msg, KVEvents):
                self.kv_events.append(msg)
            elif isinstance(msg, NodeReady):
                self.readies.append(msg)
            elif isinstance(msg, FirstToken):
                self.seen[msg.request_id].first_token = msg.token
                self.seen[msg.request_id].first = msg
                fork_ids = self.forks.get(msg.request_id, [])
                assert len(msg.fork_tokens) == len(fork_ids), msg
                for fork_id, token in zip(fork_ids, msg.fork_tokens, strict=True):
                    self.seen[fork_id].first_token = token
            elif isinstance(msg, StepTokens):
                self.steps.append(msg)
                for out in msg.outputs():
                    seen = self.seen[out.request_id]
                    assert seen.finish_reason is None, f"tokens after the end of {out.request_id}"
                    seen.token_ids += out.token_ids
                    seen.logprobs += out.logprobs
                    seen.top_ids += out.top_ids
                    seen.finish_reason = out.finish_reason
            elif isinstance(msg, RequestError):
                self.seen[msg.request_id].errors.append(msg)
            elif isinstance(msg, Preempted):
                seen = self.seen[msg.request_id]
                assert seen.finish_reason is None and seen.preempted is None, msg
                assert msg.num_tokens == len(seen.token_ids) + 1, "Preempted before its Tokens"
                seen.preempted = msg
            else:
                raise AssertionError(f"unexpected message {msg}")

    def run_until(self, cond, what="the requests to end") -> None:
        deadline = time.monotonic() + TIMEOUT
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            self.step()

    def run_all(self) -> None:
        self.run_until(lambda: all(s.is_over for s in self.seen.values()))

    def settle(self, steps=3) -> None:
        for _ in range(steps):
            self.step()

    @property
    def decode_pages_used(self) -> int:
        """Pages D's requests hold, and those an overlapped forward still holds back (those its
        prefix cache keeps for later prompts not counted)."""
        allocator, cache = self.decode.pool.allocator, self.decode.prefix_cache
        cached = cache.num_cached_pages if cache is not None else 0
        return allocator.num_used + allocator.num_held - cached

    @property
    def prefill_pages_used(self) -> int:
        """Pages P's requests hold (those its prefix cache keeps for later prompts not counted)."""
        return self.prefill.scheduler.num_request_pages

    def close(self) -> None:
        self.prefill.close("test over")
        self.decode.close("test over")
