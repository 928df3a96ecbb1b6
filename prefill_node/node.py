"""The prefill node's loop: chunked prefill, KV streamed to decode nodes, first token to the router.

`step()` is five numbered steps; socket I/O lives in the inbox/outbox (`control.messaging`) and
the KV senders (`kvtransfer`), so tests run the same loop with in-process queues and senders.

Every request ends in exactly one of: FirstToken to the router plus kv_done to D (finished), or
RequestError to the router plus kv_abort to D (failed), or silence after an Abort from the router
(plus kv_abort to D), also when its router's lease lapses (`control.lease`), or silence after a
kv_cancel from D (D gave up on it, and has told the router, or heard from it). Its pages are freed
on every path before the step returns. SIGTERM drains: the queued requests (and any Prefill
already on its way) are finished, for at most `drain_s`, then the loop stops.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch

from control.cluster_config import PrefillNodeConfig, TimeoutConfig
from control.cost_model import RecentSamples
from control.errors import DuetError
from control.logprobs import TokenLogprobs
from control.messaging import Inbox, Outbox, StageTimes
from control.prompt import validate_prompt
from control.protocol import (
    Abort,
    FirstToken,
    Heartbeat,
    Prefill,
    ProtocolError,
    RequestError,
    sampling_from_dict,
)
from control.quant_schemes import attention_scheme
from control.router_links import by_replica, replica_of
from control.sampling_params import SamplingParams
from control.version import package_version
from kvtransfer import KVSender, KVTransferError, Rendezvous, make_fingerprint
from kvtransfer.sealing import KEY_BYTES
from model.batch import ForwardBatch
from model.deepseek import DeepseekModel
from prefill_node.kv_senders import SenderPool
from prefill_node.scheduler import Chunk, PrefillRequest, PrefillScheduler, PrefillState
from runtime.grammar import GrammarMatcher, Grammars
from runtime.kv_disk_store import DiskKVStore
from runtime.logprobs import token_logprobs
from runtime.node_loop import NodeLoop
from runtime.penalties import PastTokens
from runtime.prefix_cache import PrefixCache, prefix_cache_figures
from runtime.sampling import request_seed, sample
from runtime.speculative import ahead_tokens

log = logging.getLogger(__name__)


class PrefillNode(NodeLoop):
    role = "prefill"
    # A multi-rank node (prefill_node.ranks) stops on a failed forward: its ranks' collectives
    # are out of step, so no forward after it would be right.
    forward_errors_are_fatal = False

    def __init__(
        self,
        name: str,
        model: DeepseekModel,
        cfg: PrefillNodeConfig,
        timeouts: TimeoutConfig,
        inbox: Inbox,
        outbox: Outbox,
        sender_factory: Callable[[], KVSender],
    ):
        super().__init__(name, timeouts, inbox, outbox)
        self.model = model
        # Heartbeats between layers too: one forward may outlast the router's node timeout.
        model.between_layers = self.maybe_heartbeat
        self.pool = model.new_kv_pool(cfg.num_pages, cfg.page_size)
        mcfg = model.cfg
        self.fingerprint = make_fingerprint(
            mcfg.fingerprint(), model.num_kv_layers, mcfg.kv_row_width, model.dtype
        )
        self.prefix_cache = None
        if cfg.prefix_cache:
            self.prefix_cache = PrefixCache(
                self.pool, on_change=self.publish_cache_change, store=self._disk_store(cfg)
            )
        self.scheduler = PrefillScheduler(
            self.pool, cfg.chunk_size, cfg.max_batch_tokens, self.prefix_cache
        )
        # A handshake blocks the loop: keep it well inside the router's node timeout.
        handshake_s = min(timeouts.reserve_s, timeouts.node_timeout_s / 2)
        self.senders = SenderPool(sender_factory, self.fingerprint, handshake_s)
        self.stage_times = StageTimes()
        # Structured output: grammars over the model's vocabulary (tokenizer loaded on first use).
        self.grammars = Grammars(model.model_dir, mcfg.vocab_size, mcfg.eos_token_id)
        self.timing_samples = RecentSamples()  # forwards since the last heartbeat (SLA admission)
        self.kv_bytes_sent = 0
        self.kv_rows_sent = 0  # prompt rows sent to decode nodes, cumulative
        self.kv_rows_skipped = 0  # and not sent, the decode node holding them (skip_rows)
        self.num_cancelled_by_decode = 0  # requests stopped by a kv_cancel
        # Each router's numbering of its Prefills: the last one taken, per router replica.
        self.prefill_seqs: dict[int, int] = {}
        self._is_stalled = False  # last schedule found nothing to run although work is queued
        self._has_failed = False  # NodeFailed sent (report_failure)

    def _disk_store(self, cfg: PrefillNodeConfig) -> DiskKVStore | None:
        """The prefix cache's disk tier, keyed by everything that makes two nodes' rows equal:
        the model and KV layout, the page size, and the weights' schemes."""
        if not cfg.disk_cache_dir:
            return None
        layout = {**self.fingerprint, "page_size": self.pool.page_size, "quant": self.model.quant}
        if self.model.attention_quant != attention_scheme(self.model.quant):
            # named only when not `quant`'s default: a default node keeps its existing store
            layout["attention"] = self.model.attention_quant
        shape = (self.pool.num_layers, self.pool.page_size, self.pool.row_width)
        size = int(cfg.disk_cache_gb * 2**30)
        return DiskKVStore(cfg.disk_cache_dir, layout, shape, self.pool.dtype, size)

    def ready_info(self) -> dict[str, Any]:
        """What NodeReady carries."""
        return {
            "fingerprint": self.fingerprint,
            "dtype": self.fingerprint["dtype"],
            "num_pages": self.pool.num_pages,
            "page_size": self.pool.page_size,
            "version": package_version(),
            "quant": self.model.quant,  # the weights' scheme: "none" | "int8" | "fp8" | "int4"
            "lm_head": self.model.lm_head_quant,  # the LM head's: "none" | "int8"
            "attention": self.model.attention_quant,  # the attention projections' scheme
            # Where the weights live: a mapped pack (file or shmem, which pages) or the heap.
            "weights_backing": self.model.weights_backing,
            "weights": self.model.weights_detail,
        }

    def num_held(self) -> int:
        return len(self.scheduler.requests)

    def report_failure(self, exc: BaseException) -> None:
        """From here on the decode nodes get no kv_abort: one would reach the router through D
        (RequestError) maybe before the NodeFailed, and fail the request; the router's move
        aborts D's reservation instead."""
        self._has_failed = True
        super().report_failure(exc)

    def on_router_restart(self, replica: int) -> None:
        self.prefill_seqs.pop(replica, None)  # the new router numbers its Prefills from 1

    def step(self) -> None:
        # 1. Block when idle: wait for a control message only if there is nothing to compute.
        is_busy = self.scheduler.has_work() and not self._is_stalled
        wait = 0.0 if is_busy else min(0.05, self.timeouts.heartbeat_s)
        # 2. Drain inputs: prefill requests, aborts, shutdown; and the decode nodes' cancels.
        self.take_messages(wait)
        for endpoint, rendezvous, reason in self.senders.poll_cancels():
            self._on_cancel(endpoint, rendezvous, reason)
        # 3. Fail requests that waited too long for their turn.
        now = time.monotonic()
        for request in self.scheduler.expire(now):
            self._fail(request, "prefill_queue", request.error)
        self.check_lease_and_drain(now)
        # 4. One forward over the scheduled chunks; rows stream out while the next one computes.
        chunks = self.scheduler.schedule(now)
        self._is_stalled = not chunks
        if chunks:
            started = time.monotonic()
            self._run_chunks(chunks)
            self._record_forward(chunks, started)
        # 5. Heartbeat with the load figures the router pairs by.
        self.maybe_heartbeat()

    # ---- inputs ----------------------------------------------------------------------------
    def handle(self, msg: Any) -> None:
        if isinstance(msg, Prefill):
            self._on_prefill(msg)
        elif isinstance(msg, Abort):
            request = self.scheduler.abort(msg.request_id, f"aborted: {msg.reason}")
            if request is not None:
                log.info("request %s: aborted by the router (%s)", msg.request_id, msg.reason)
                self._abort_peer(request, f"aborted by the router: {msg.reason}")
        else:
            super().handle(msg)

    def _on_cancel(self, endpoint: str, rendezvous: Rendezvous, reason: str) -> None:
        """D gave up on the request (aborted, expired, refused its KV): stop computing it and
        free its pages. No word to anyone: D has told the router already (RequestError), or
        acts on the router's own Abort; and D wants no kv_abort for it."""
        request = self.scheduler.get(rendezvous.request_id)
        if request is None or request.room != rendezvous.room or request.kv_endpoint != endpoint:
            return  # finished, failed or retried meanwhile: nothing of it left to stop
        log.info("request %s: cancelled by the decode node (%s)", request.request_id, reason)
        self.scheduler.abort(request.request_id, f"cancelled by the decode node: {reason}")
        self.num_cancelled_by_decode += 1

    def orphan(self, replica: int, reason: str) -> None:
        """Drops the requests of router `replica` (no live router owns them) and tells their
        decode nodes."""
        orphans = [r for r in self.scheduler.requests if replica_of(r.request_id) == replica]
        if orphans:
            log.warning("aborting %d requests: %s", len(orphans), reason)
        for request in orphans:
            log.info("request %s: aborted (%s)", request.request_id, reason)
            self.scheduler.abort(request.request_id, reason)
            self._abort_peer(request, reason)

    def _on_prefill(self, msg: Prefill) -> None:
        replica = replica_of(msg.request_id)  # taken, whatever comes next:
        self.prefill_seqs[replica] = max(self.prefill_seqs.get(replica, 0), msg.seq)
        cfg = self.model.cfg
        try:
            params = sampling_from_dict(msg.sampling)
            params.check_vocab(cfg.vocab_size)
            validate_prompt(msg.token_ids, cfg.vocab_size, cfg.max_position_embeddings)
            if not msg.kv_endpoint:
                raise ProtocolError("the Prefill message names no kv_endpoint")
            now = time.monotonic()
            queue_s = msg.timeout_s if msg.timeout_s > 0 else self.timeouts.prefill_queue_s
            request = PrefillRequest(
                msg.request_id,
                msg.room,
                list(msg.token_ids),
                params,
                msg.kv_endpoint,
                arrival=now,
                queue_deadline=now + queue_s,
                grammar=self.grammar_for(params, msg.token_ids),
                kv_key=_transfer_key(msg.kv_key),
                skip_rows=msg.skip_rows,
            )
            if not 0 <= msg.skip_rows <= len(msg.token_ids):
                raise ProtocolError(f"skip_rows {msg.skip_rows} outside the prompt")
            self.scheduler.add(request)
            self.scheduler.prefetch(request)  # the disk tier reads ahead while it queues
        except (DuetError, ValueError, TypeError) as exc:
            self.outbox.send(RequestError(msg.request_id, "prefill", f"bad request: {exc}"))
            return
        try:  # first contact with this decode node: the handshake checks compatibility
            self.senders.get(msg.kv_endpoint)
        except KVTransferError as exc:
            self.scheduler.abort(msg.request_id)
            self.outbox.send(RequestError(msg.request_id, "transfer", str(exc)))

    # ---- compute ---------------------------------------------------------------------------
    def _run_chunks(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:  # D gets the cached prefix too: it travels while this forward runs
            if chunk.start == chunk.request.num_cached > 0:
                self._send_cached_prefix(chunk.request)
        chunks = [c for c in chunks if c.request.state == PrefillState.RUNNING]  # sends can fail
        if not chunks:
            return
        batch = ForwardBatch.build(
            self.pool,
            [c.request.table for c in chunks],
            [c.tokens for c in chunks],
            [c.start for c in chunks],
            is_decode=False,
        )
        extra = _prompt_logprob_positions(chunks)
        if extra:
            batch.extra_logit_index = torch.tensor([index for index, _, _ in extra])
        try:
            with self._beating():  # heartbeats between layers: a forward may be long
                if self.model.mtp is None:
                    logits = self.forward(batch)  # [B (+ N), vocab] fp32
                else:  # MTP: sample the first tokens now, the MTP layer needs them before the send
                    logits, hidden = self.forward_with_hidden(batch)
                    firsts = self._first_tokens_of(chunks, logits)
                    firsts = self._run_mtp(chunks, hidden, firsts)
        except Exception as exc:  # fail these requests loudly, keep serving the others
            if self.forward_errors_are_fatal:
                raise
            log.exception("prefill forward failed")
            for chunk in chunks:
                self._fail(chunk.request, "prefill", f"prefill forward failed: {exc}")
            return
        if extra:
            self._add_prompt_logprobs(logits[len(chunks) :], extra)
        for chunk in chunks:
            self._send_chunk(chunk)
        finished = self.scheduler.update(chunks)
        if not finished:
            return
        if self.model.mtp is not None:
            for request in finished:
                self._finish(request, *firsts[id(request)])
            return
        row_of = {id(c.request): i for i, c in enumerate(chunks) if c.is_last}
        rows = logits[[row_of[id(r)] for r in finished]]
        for request, (tokens, lps) in zip(
            finished, self._first_tokens(rows, finished), strict=True
        ):
            self._finish(request, tokens, lps)

    @contextmanager
    def _beating(self):
        """The model's forwards within: heartbeats go on between their layers, so a forward
        longer than the router's node timeout (a full-depth chunk) is not taken for a death.
        Only once the forward has run for heartbeat_s: a short forward's figures go out after
        it, as they always did."""
        started = time.monotonic()

        def beat() -> None:
            if time.monotonic() - started >= self.timeouts.heartbeat_s:
                self.maybe_heartbeat()

        self.model.between_layers = beat
        try:
            yield
        finally:
            self.model.between_layers = None

    # The model's three forwards: hooks a multi-rank node overrides to run each on every rank.
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.forward(batch, self.pool)

    def forward_with_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.forward_with_hidden(batch, self.pool)

    def forward_mtp(self, batch: ForwardBatch, hidden: torch.Tensor):
        return self.model.forward_mtp(batch, hidden, self.pool)

    def _first_tokens_of(self, chunks: list[Chunk], logits: torch.Tensor) -> dict[int, tuple]:
        """The first tokens and logprobs of the requests whose prompt ends in this forward, by
        id(request) (MTP samples them before `update`, which frees the requests' pages)."""
        last = [(i, c.request) for i, c in enumerate(chunks) if c.is_last]
        if not last:
            return {}
        rows = logits[[i for i, _ in last]]
        sampled = self._first_tokens(rows, [r for _, r in last])
        return {id(r): out for (_, r), out in zip(last, sampled, strict=True)}

    def _run_mtp(self, chunks: list[Chunk], hidden: torch.Tensor, firsts: dict) -> dict:
        """The MTP layer behind the main forward, at the same positions (its rows join the
        chunks' KV); a finishing request's entry gains the layer's draft of its second token."""
        ahead = [
            ahead_tokens(
                c.request.token_ids,
                c.start,
                c.end,
                firsts[id(c.request)][0][0] if c.is_last else -1,
            )
            for c in chunks
        ]
        mtp_batch = ForwardBatch.build(
            self.pool, [c.request.table for c in chunks], ahead, [c.start for c in chunks], False
        )
        logits, _ = self.forward_mtp(mtp_batch, hidden)
        drafts = logits[: len(chunks)].argmax(-1).tolist()
        return {
            id(c.request): (*firsts[id(c.request)], (drafts[i],))
            for i, c in enumerate(chunks)
            if c.is_last
        }

    def _first_tokens(self, rows: torch.Tensor, finished: list[PrefillRequest]):
        """Each finished request's first tokens, one per sequence (n > 1: sequence i samples
        by `params.for_sequence(i)` from the same logits), with their logprobs: one batched
        sample over every sequence of every request."""
        owner = [j for j, r in enumerate(finished) for _ in range(r.params.n)]
        index = [i for r in finished for i in range(r.params.n)]
        params = [finished[j].params.for_sequence(i) for j, i in zip(owner, index, strict=True)]
        seeds = [request_seed(p) for p in params]  # resolved once: this is the request's only draw
        prompts = [finished[j].token_ids for j in owner]
        cfg = self.model.cfg
        past = PastTokens.of_prompts(prompts, params, cfg.eos_token_id, cfg.vocab_size)
        rows = rows[owner] if len(owner) > len(finished) else rows
        # Structured output: a fresh grammar's first mask (computed once per request, shared by
        # its sequences), ~0.05 ms a row next to the forward, so in line.
        masks = self.grammars.compute_masks([finished[j].grammar for j in owner])
        allowed = rows if masks is None else masks.apply(rows)
        # The first draw: 0, or after an earlier attempt's tokens (a preempted or moved request).
        tokens = sample(allowed, params, seeds, [p.draw_offset for p in params], past)
        logprobs = token_logprobs(rows, tokens, [p.logprobs for p in params])
        out = [([], []) for _ in finished]
        for j, token, lp in zip(owner, tokens, logprobs, strict=True):
            out[j][0].append(token)
            out[j][1].append(lp)
        return out

    def grammar_for(self, params: SamplingParams, prompt_ids: list[int]) -> GrammarMatcher | None:
        """The matcher of a structured request at its grammar's start, past the output a
        restarted attempt replays from the end of `prompt_ids` (None: free text);
        InvalidRequestError when the spec does not compile."""
        return self.grammars.matcher_for(params.structured, params.resumed_output(prompt_ids))

    @staticmethod
    def _add_prompt_logprobs(logits: torch.Tensor, extra: list) -> None:
        """logits [N, vocab] of the `extra` positions -> each request's prompt logprobs."""
        targets = [request.token_ids[pos + 1] for _, request, pos in extra]
        num_top = [request.params.prompt_logprobs for _, request, _ in extra]
        for (_, request, _), lp in zip(
            extra, token_logprobs(logits, targets, num_top, ranks=True), strict=True
        ):
            request.prompt_logprobs.append(lp)

    def _send_chunk(self, chunk: Chunk) -> None:
        self._send_rows(chunk.request, chunk.start, chunk.end)

    def _send_cached_prefix(self, request: PrefillRequest) -> None:
        """Rows [skip_rows, num_cached) from the cache's pages, in chunk_size pieces (bounded
        frames): the decode node gets every row of the prompt it does not hold."""
        step = self.scheduler.chunk_size
        for start in range(request.skip_rows, request.num_cached, step):
            self._send_rows(request, start, min(start + step, request.num_cached))

    def _send_rows(self, request: PrefillRequest, start: int, end: int) -> None:
        """Rows [start, end) of the prompt to its decode node, less those it holds."""
        if request.state != PrefillState.RUNNING:
            return  # failed earlier in this step (its endpoint broke)
        start = max(start, request.skip_rows)
        if start >= end:
            return
        num_layers = self.pool.num_layers
        rows = self.pool.read_rows(request.table, 0, num_layers, start, end)
        try:
            sender = self.senders.get(request.kv_endpoint)
            sender.send_chunk(_rendezvous(request), 0, start, rows, key=request.kv_key)
        except (KVTransferError, ValueError) as exc:
            self._on_sender_error(request, exc)
            return
        self.kv_bytes_sent += rows.numel() * rows.element_size()
        self.kv_rows_sent += end - start

    def _finish(
        self,
        request: PrefillRequest,
        tokens: list[int],
        lps: list[TokenLogprobs | None],
        draft: tuple[int, ...] = (),
    ) -> None:
        """Hands the request on: FirstToken to the router, then kv_done to D, each with the
        first token of every sequence (n > 1: the first is the request's own). In this order
        the router practically always sees the first token before D's next ones (they travel
        on different connections, so the router must still tolerate the reverse)."""
        now = time.monotonic()
        stage_ms = {
            "queue": (request.start_time - request.arrival) * 1000.0,
            "prefill": (now - request.start_time) * 1000.0,
        }
        for stage, ms in stage_ms.items():
            self.stage_times.add(stage, ms / 1000.0)
        self.outbox.send(_first_token(request, tokens, stage_ms, lps))
        self.kv_rows_skipped += request.skip_rows
        log.info(
            "request %s: prefilled %d tokens, %d from the cache, %d held by D (queue %.1f ms,"
            " prefill %.1f ms) -> %s",
            request.request_id,
            request.prompt_len,
            request.num_cached,
            request.skip_rows,
            stage_ms["queue"],
            stage_ms["prefill"],
            request.kv_endpoint,
        )
        try:
            sender = self.senders.get(request.kv_endpoint)
            sender.send_done(
                _rendezvous(request),
                request.prompt_len,
                tokens[0],
                tuple(tokens[1:]),
                draft,
                key=request.kv_key,
            )
        except (KVTransferError, ValueError) as exc:
            self._on_sender_error(request, exc)

    def _record_forward(self, chunks: list[Chunk], started: float) -> None:
        """One timing sample for the router's cost model of this node: the whole forward as
        the loop spends it (rows read and handed to the senders, first tokens sampled)."""
        new = sum(c.end - c.start for c in chunks)
        attention = sum((c.end - c.start) * c.start for c in chunks)
        self.timing_samples.add(new, attention, time.monotonic() - started)

    # ---- failures --------------------------------------------------------------------------
    def _on_sender_error(self, request: PrefillRequest, exc: Exception) -> None:
        """A broken sender loses every in-flight transfer to that endpoint: fail them all."""
        endpoint = request.kv_endpoint
        self.senders.drop(endpoint)
        message = f"KV transfer to {endpoint} failed: {exc}"
        self._fail(request, "transfer", message)
        for other in self.scheduler.requests:
            if other.kv_endpoint == endpoint and other.state == PrefillState.RUNNING:
                self._fail(other, "transfer", message)

    def _fail(self, request: PrefillRequest, stage: str, message: str) -> None:
        """Frees the request (if still held), tells D to drop it and the router why."""
        log.warning("request %s: failed at %s: %s", request.request_id, stage, message)
        self.scheduler.abort(request.request_id, message)
        self._abort_peer(request, message)
        self.outbox.send(RequestError(request.request_id, stage, message))

    def _abort_peer(self, request: PrefillRequest, reason: str) -> None:
        """Best effort kv_abort, so D frees its reservation now rather than at its deadline
        (none once the node has failed: `report_failure`)."""
        sender = self.senders.peek(request.kv_endpoint)
        if sender is None or self._has_failed:
            return
        try:
            sender.send_abort(_rendezvous(request), reason, key=request.kv_key)
        except (KVTransferError, ValueError):
            pass  # D's deadline (or the router's Abort) reclaims its pages instead

    def heartbeat(self) -> Heartbeat:
        _, queued_attention, queued_forwards = self.scheduler.queued_work()
        return Heartbeat(
            self.name,
            "prefill",
            queued_tokens=self.scheduler.queued_tokens,
            num_waiting=self.scheduler.num_waiting,
            num_running=self.scheduler.num_running,
            kv_bytes_sent=self.kv_bytes_sent,
            kv_rows_sent=self.kv_rows_sent,
            kv_rows_skipped=self.kv_rows_skipped,
            num_cancelled_by_decode=self.num_cancelled_by_decode,
            num_malformed=self.inbox.num_malformed,
            stage_ms=self.stage_times.means(),
            draining=self.is_draining,
            **prefix_cache_figures(self.prefix_cache),
            timing_samples=self.timing_samples.take(),
            queued_attention=float(queued_attention),
            queued_forwards=queued_forwards,
            prefill_seqs=by_replica(self.prefill_seqs),
        )

    def close(self, reason: str) -> None:
        """Fails whatever is still queued (the router hears of each) and closes the senders."""
        for request in self.scheduler.requests:
            self._fail(request, "prefill", reason)
        self.senders.close()
        if self.prefix_cache is not None and self.prefix_cache.store is not None:
            self.prefix_cache.store.close()
        self.grammars.close()


def _rendezvous(request: PrefillRequest) -> Rendezvous:
    return Rendezvous(request.request_id, request.room)


def _prompt_logprob_positions(chunks: list[Chunk]) -> list[tuple[int, PrefillRequest, int]]:
    """(packed index, request, prompt position) of every chunk token whose logits give a prompt
    logprob: those of requests that asked, but the prompt's last (its logits give the output)."""
    out, offset = [], 0
    for chunk in chunks:
        request = chunk.request
        if request.params.prompt_logprobs is not None:
            for pos in range(chunk.start, min(chunk.end, request.prompt_len - 1)):
                out.append((offset + pos - chunk.start, request, pos))
        offset += chunk.end - chunk.start
    return out


def _first_token(
    request: PrefillRequest,
    tokens: list[int],
    stage_ms: dict[str, float],
    lps: list[TokenLogprobs | None],
) -> FirstToken:
    prompt = request.prompt_logprobs
    lp, fork_lps = lps[0], [x for x in lps[1:] if x is not None]
    return FirstToken(
        request.request_id,
        tokens[0],
        request.prompt_len,
        stage_ms,
        cached_tokens=request.num_cached,
        logprob=[] if lp is None else [lp.logprob],
        top_ids=[] if lp is None else lp.top_ids,
        top_logprobs=[] if lp is None else lp.top_logprobs,
        fork_tokens=tokens[1:],
        fork_logprobs=[x.logprob for x in fork_lps],
        fork_top_ids=[x.top_ids for x in fork_lps],
        fork_top_logprobs=[x.top_logprobs for x in fork_lps],
        prompt_logprobs=[p.logprob for p in prompt],
        prompt_top_ids=[p.top_ids for p in prompt],
        prompt_top_logprobs=[p.top_logprobs for p in prompt],
        prompt_ranks=[p.rank for p in prompt],
    )


def _transfer_key(key: bytes) -> bytes | None:
    """The Prefill's transfer key (kvtransfer.sealing), None when its KV goes unsealed."""
    if not key:
        return None
    if len(key) != KEY_BYTES:
        raise ProtocolError(f"the Prefill message's kv_key is {len(key)} bytes, not {KEY_BYTES}")
    return key
