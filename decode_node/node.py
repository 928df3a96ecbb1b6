"""The decode node's loop: reserve, receive KV, decode with continuous batching, stream tokens.

`step()` is six numbered steps; socket I/O lives in the inbox/outbox (`control.messaging`) and
the KV receiver (`kvtransfer`), so tests run the same loop with in-process queues and receiver.

Every reserved request ends in exactly one of: its StepTokens entry with a finish_reason
(finished; a step's outputs go out as one StepTokens), RequestError (failed: refused KV,
timeout), Preempted (the pool ran out under on-demand reservation: `decode_node.scheduler`;
sent after the request's tokens, the router re-prefills it), or silence after an Abort from
the router (or after its router's lease lapsed:
`control.lease`). SIGTERM drains: no new reservations, the held
requests finish (for at most `drain_s`), then the loop stops. Its pages
are freed on every path in the step that ends it; while its KV is in flight they are lent to
the receiver, and the loop takes them back (`cancel`) before freeing them. A request given up on
while its KV is in flight (abort, deadline, refused KV, shutdown) is also cancelled on P, by the
receiver's kv_cancel, so P stops computing it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from control.cluster_config import DecodeNodeConfig, SlaConfig, TimeoutConfig
from control.cost_model import DecodeCost, RecentSamples
from control.errors import ConfigError, DuetError
from control.logprobs import TokenLogprobs
from control.messaging import Inbox, Outbox, StageTimes
from control.prompt import validate_prompt
from control.protocol import (
    Abort,
    Heartbeat,
    Preempted,
    RequestError,
    RequestTokens,
    Reserve,
    ReserveReply,
    sampling_from_dict,
    step_tokens_messages,
)
from control.router_links import replica_of
from control.sampling_params import SamplingParams
from control.version import package_version
from decode_node.scheduler import DecodeRequest, DecodeScheduler, DecodeState, StepOutput
from decode_node.speculative_step import SpeculativeStep
from decode_node.step_overlap import StepOverlap
from kvtransfer import KVReceiver, Rendezvous, TransferEvent, make_fingerprint
from kvtransfer.sealing import new_key
from model.batch import ForwardBatch
from model.deepseek import DeepseekModel
from runtime.block_table import BlockTable
from runtime.grammar import GrammarMatcher, Grammars, TokenMasks
from runtime.logprobs import token_logprobs
from runtime.node_loop import NodeLoop
from runtime.penalties import TokenCounts
from runtime.prefix_cache import PrefixCache, prefix_cache_figures
from runtime.sampling import request_seed, sample

log = logging.getLogger(__name__)

Outputs = tuple[list[StepOutput], "dict[str, list[TokenLogprobs]] | None"]  # a step's, to emit


@dataclass
class StartedStep:
    """A decode step whose batch is built: its requests (in row order), the ForwardBatch, the
    structured rows' masks (computed beside the forward) and when it started."""

    batch: list[DecodeRequest]
    fb: ForwardBatch
    masks: concurrent.futures.Future[TokenMasks | None]
    started: float


class DecodeNode(NodeLoop):
    """A decode node on the node-loop base. Its step's parts are public for the rank variant
    (`decode_node.ranks`), which runs them in its own lockstep turn: `on_transfer`,
    `report_error`, `decode_batch`, `report_preempted`, `abort_all`; the speculative step
    reuses `sample_tokens`, `advance_grammar` and `fail_forward` (`DecodeSteps`)."""

    role = "decode"
    # A multi-rank node (decode_node.ranks) sets these: its rank answers reservations, and a
    # failed forward is fatal there (the ranks' collectives would no longer match).
    rank = 0
    num_ranks = 1
    forward_errors_are_fatal = False
    supports_overlap = True  # a multi-rank node's steps run in lockstep, one after another

    def __init__(
        self,
        name: str,
        model: DeepseekModel,
        cfg: DecodeNodeConfig,
        timeouts: TimeoutConfig,
        inbox: Inbox,
        outbox: Outbox,
        receiver: KVReceiver,
        sla: SlaConfig | None = None,
    ):
        """`receiver` must be bound to `model`'s KV layout over `receiver.pool`, which this node
        decodes from. With `sla` (and its `cap_decode_batch`), the running batch is capped so
        the predicted step stays within `tpot_ms`."""
        super().__init__(name, timeouts, inbox, outbox)
        self.model = model
        self.receiver = receiver
        self.pool = receiver.pool
        mcfg = model.cfg
        if cfg.prefix_cache:  # finished prompts' KV kept: a later prompt receives only the rest
            self.prefix_cache = PrefixCache(
                self.pool, holds_pages=True, on_change=self.publish_cache_change
            )
        self.scheduler = DecodeScheduler(
            self.pool,
            cfg.max_batch,
            mcfg.max_position_embeddings,
            frozenset(mcfg.eos_token_id),
            reservation=cfg.kv_reservation,
            headroom_tokens=cfg.kv_headroom_tokens,
            prefix_cache=self.prefix_cache,
        )
        self.token_counts = TokenCounts(cfg.max_batch, mcfg.vocab_size)  # by batch slot
        # The running batch's page tables, kept across steps by batch slot.
        max_pages = -(-mcfg.max_position_embeddings // self.pool.page_size) + 1
        self.block_table = BlockTable(cfg.max_batch, max_pages)
        self.fingerprint = make_fingerprint(
            mcfg.fingerprint(), model.num_kv_layers, mcfg.kv_row_width, model.dtype
        )
        self.stage_times = StageTimes()
        # Structured output: grammars over the model's vocabulary (tokenizer loaded on first use).
        self.grammars = Grammars(model.model_dir, mcfg.vocab_size, mcfg.eos_token_id)
        # SLA: this node's step-time model, its samples for the router.
        self.step_cost = DecodeCost()
        self.timing_samples = RecentSamples()
        self.tpot_s = sla.tpot_ms / 1000.0 if sla is not None and sla.cap_decode_batch else None
        # MTP speculative decoding: drafts from the model's MTP layer.
        self.speculative: SpeculativeStep | None = None
        if cfg.mtp:
            if model.mtp is None:
                raise ConfigError(f"node {name}: mtp = true needs the model's MTP layer loaded")
            self.speculative = SpeculativeStep(self, cfg.mtp_tokens)
        # The overlapped step: the loop's work beside the forward (step_overlap).
        overlap = cfg.overlap and self.supports_overlap and self.speculative is None
        self.overlap = StepOverlap(self.pool) if overlap else None
        self._unsent: Outputs | None = None  # overlap: the last step's, sent during the next

    def ready_info(self) -> dict[str, Any]:
        """What NodeReady carries."""
        return {
            "kv_endpoint": self.receiver.endpoint,
            "num_pages": self.pool.num_pages,
            "page_size": self.pool.page_size,
            "ranks": self.num_ranks,
            "fingerprint": self.fingerprint,
            "dtype": self.fingerprint["dtype"],
            "version": package_version(),
            "quant": self.model.quant,  # the weights' scheme: "none" | "int8" | "fp8" | "int4"
            "lm_head": self.model.lm_head_quant,  # the LM head's: "none" | "int8"
            "attention": self.model.attention_quant,  # the attention projections' scheme
            # Where the weights live: a mapped pack (file or shmem, which pages) or the heap.
            "weights_backing": self.model.weights_backing,
            "weights": self.model.weights_detail,
            # On-demand decode KV: the router estimates reservations by the same rule.
            "kv_reservation": self.scheduler.reservation,
            "kv_headroom_tokens": self.scheduler.headroom_tokens,
            # Prefix reuse: the router sends it every prompt's ids and pairs by its cache.
            "prefix_cache": self.prefix_cache is not None,
        }

    def num_held(self) -> int:
        return len(self.scheduler.requests)

    def step(self) -> None:
        """One turn of the loop: 1-4 take in what came, 5 decodes, 6 tells the router. With
        overlap, 5's forward runs while a helper does the rest: the previous step's tokens go
        out, then 1-4 and 6 (`decode_node.step_overlap`)."""
        if self.overlap is not None:
            return self._overlapped_step()
        self._take_inputs(self._idle_wait())
        # 5. One decode step over the running batch (requests join and leave at every step).
        batch = self.scheduler.schedule(self.batch_cap())
        self.report_preempted()
        if batch:
            self.decode_batch(batch)
        # 6. Heartbeat with the free pages the router admits by.
        self.maybe_heartbeat()

    def _overlapped_step(self) -> None:
        batch = self.scheduler.schedule(self.batch_cap())  # after the last step's inputs
        unsent, self._unsent = self._unsent, None

        def loop_side(wait: float = 0.0) -> None:
            if unsent is not None:
                self._emit(*unsent)
            self.report_preempted()  # after the StepTokens of the victims' last tokens
            self._take_inputs(wait)
            self.maybe_heartbeat()

        if not batch:
            return loop_side(self._idle_wait())
        step = self._start_step(batch)
        logits, error = self.overlap.run(loop_side, lambda: self.model.forward(step.fb, self.pool))
        self._unsent = self._finish_step(step, logits, error)

    def _idle_wait(self) -> float:
        """1. Block when idle: wait for a control message only if there is nothing to decode;
        wait briefly while KV is in flight so a finished transfer is seen soon."""
        if self.scheduler.has_runnable():
            return 0.0
        if self.scheduler.count(DecodeState.AWAITING_KV):
            return 0.001
        return min(0.05, self.timeouts.heartbeat_s)

    def _take_inputs(self, wait: float) -> None:
        # 2. Drain inputs: reservations, aborts, shutdown.
        self.take_messages(wait)
        # 3. Drain transfer events: complete KV joins the batch, anything else fails.
        for event in self.receiver.poll(0.001 if wait else 0.0):
            self.on_transfer(event)
        # 4. Fail requests that decoded too long; drop everything if the router's lease lapsed.
        now = time.monotonic()
        for request in self.scheduler.expire(now):
            self.report_error(request.request_id, "decode", f"decode timed out: {request.error}")
        self.check_lease_and_drain(now)

    # ---- inputs ----------------------------------------------------------------------------
    def handle(self, msg: Any) -> None:
        if isinstance(msg, Reserve):
            self._on_reserve(msg)
        elif isinstance(msg, Abort):
            self._abort(msg.request_id, f"aborted: {msg.reason}")
        else:
            super().handle(msg)

    def orphan(self, replica: int, reason: str) -> None:
        self.abort_all(reason, replica)

    def abort_all(self, reason: str, replica: int) -> None:
        """Aborts every held request of router `replica`: no live router owns them any more."""
        orphans = [r for r in self.scheduler.requests if replica_of(r.request_id) == replica]
        if orphans:
            log.warning("aborting %d requests: %s", len(orphans), reason)
        for request in orphans:
            self._abort(request.request_id, reason)

    def _on_reserve(self, msg: Reserve) -> None:
        def refuse(reason: str, draining: bool = False) -> None:
            self.outbox.send(
                ReserveReply(msg.request_id, ok=False, reason=reason, draining=draining)
            )

        if self.is_stopping or self.is_draining:
            return refuse("the decode node is draining", draining=True)
        try:
            params = self._check_sampling(msg)
            grammar = self.grammar_for(params, msg.prompt_ids)
        except (DuetError, ValueError, TypeError) as exc:
            return refuse(f"bad sampling parameters: {exc}")
        now = time.monotonic()
        request, reason = self.scheduler.reserve(
            msg.request_id,
            msg.room,
            msg.prompt_len,
            params,
            now,
            msg.priority,
            tuple(msg.fork_ids),
            msg.prompt_ids,
        )
        if request is None:
            return refuse(reason)
        for sequence in (request, *request.forks):  # n > 1: each sequence its own stream
            sequence.seed = request_seed(sequence.params)  # P drew its draw 0, D continues at 1
        # Structured output: each sequence walks the grammar on its own copy.
        request.grammar = grammar
        for fork in request.forks:
            fork.grammar = None if grammar is None else grammar.fork()
        timeout = msg.timeout_s if msg.timeout_s > 0 else self.timeouts.transfer_s
        key = new_key() if self.receiver.seals else None  # one per transfer (kvtransfer.sealing)
        try:
            self.receiver.expect(
                _rendezvous(request),
                request.table,
                msg.prompt_len,
                now + timeout,
                key,
                first_row=request.num_cached,
            )
        except ValueError as exc:
            self.scheduler.abort(msg.request_id)
            return refuse(f"cannot expect the KV: {exc}")
        self.outbox.send(
            ReserveReply(
                msg.request_id,
                ok=True,
                kv_endpoint=self.receiver.endpoint,
                rank=self.rank,
                kv_key=key or b"",
                cached_rows=request.num_cached,
            )
        )

    def _check_sampling(self, msg: Reserve) -> SamplingParams:
        cfg = self.model.cfg
        params = sampling_from_dict(msg.sampling)
        params.check_vocab(cfg.vocab_size)
        if params.uses_prompt:  # the repetition penalty (or a resumed grammar) reads the prompt
            if len(msg.prompt_ids) != msg.prompt_len:
                raise ValueError(f"the sampling needs the {msg.prompt_len} prompt ids")
            validate_prompt(msg.prompt_ids, cfg.vocab_size, cfg.max_position_embeddings)
        return params

    def grammar_for(self, params: SamplingParams, prompt_ids: list[int]) -> GrammarMatcher | None:
        """The matcher of a structured request at its grammar's start, past the output a
        restarted attempt replays from the end of `prompt_ids` (None: free text);
        InvalidRequestError when the spec does not compile. A sequence forked from another
        before its first token takes `parent.grammar.fork()` instead, then consumes its own
        first token."""
        return self.grammars.matcher_for(params.structured, params.resumed_output(prompt_ids))

    def on_transfer(self, event: TransferEvent) -> None:
        request = self.scheduler.get(event.rendezvous.request_id)
        if (
            request is None
            or request.room != event.rendezvous.room
            or request.state != DecodeState.AWAITING_KV
        ):
            log.warning("decode node ignores a stale transfer event for %s", event.rendezvous)
            return
        problem = self._transfer_problem(event)
        if problem:  # the pages hold garbage (or the token is bad): never decoded
            self.scheduler.kv_failed(request.request_id, problem)
            self.report_error(request.request_id, "transfer", problem)
            return
        now = time.monotonic()
        self.stage_times.add("reserve_to_ready", now - request.arrival)
        if len(event.fork_tokens) != len(request.forks):
            problem = (
                f"kv_done carried {len(event.fork_tokens)} fork tokens for "
                f"{len(request.forks)} sequences"
            )
            self.scheduler.kv_failed(request.request_id, problem)
            self.report_error(request.request_id, "transfer", problem)
            return
        problem = self._first_tokens_grammar_problem(request, event)
        if problem:  # never, as they were sampled under the mask: the request fails
            self.scheduler.abort(request.request_id, problem)
            self.report_error(request.request_id, "decode", problem)
            return
        outputs = self.scheduler.kv_ready(
            request.request_id,
            event.first_token,
            now,
            self.timeouts.decode_s,
            event.fork_tokens,
            event.draft_tokens if self.speculative is not None else (),
        )
        self._emit(outputs)  # the sequences whose first token already ended them

    @staticmethod
    def _first_tokens_grammar_problem(request: DecodeRequest, event: TransferEvent) -> str | None:
        """Structured output: each sequence's grammar consumes its first token (P's); why one
        refuses it, or None."""
        tokens = (event.first_token, *event.fork_tokens)
        for sequence, token in zip((request, *request.forks), tokens, strict=True):
            if sequence.grammar is not None and not sequence.grammar.consume(token):
                error = sequence.grammar.error
                return f"structured output: token {token} breaks the grammar ({error})"
        return None

    def _transfer_problem(self, event: TransferEvent) -> str | None:
        """Why this request must not be decoded (incomplete, aborted or expired KV, a bad
        first token), or None."""
        if not event.is_ready or event.first_token is None:
            return event.reason or "KV transfer failed"
        vocab_size = self.model.cfg.vocab_size
        for token in (event.first_token, *event.fork_tokens, *event.draft_tokens):
            if not 0 <= token < vocab_size:
                return f"kv_done carried token {token}, outside the vocabulary"
        return None

    def _abort(self, request_id: str, reason: str) -> None:
        request = self.scheduler.get(request_id)
        if request is None:
            return
        log.info("request %s: aborted (%s)", request_id, reason)
        if request.state == DecodeState.AWAITING_KV:
            # Take the lent pages back first; the receiver tells P to stop (kv_cancel).
            self.receiver.cancel(_rendezvous(request), reason)
        self.scheduler.abort(request_id, reason)

    # ---- compute ---------------------------------------------------------------------------
    def decode_batch(self, batch: list[DecodeRequest]) -> None:
        if self.speculative is not None:
            started = time.monotonic()
            result = self.speculative.run(batch)
            if result is not None:
                outputs, logprobs_of, _ = result
                self._record_step(batch, time.monotonic() - started)
                self._emit(outputs, logprobs_of)
            return
        step = self._start_step(batch)
        try:
            logits, error = self.model.forward(step.fb, self.pool), None  # [B, vocab] fp32
        except Exception as exc:
            logits, error = None, exc
        self._emit(*self._finish_step(step, logits, error))

    def _start_step(self, batch: list[DecodeRequest]) -> StartedStep:
        tables = [r.table for r in batch]
        fb = ForwardBatch.decode_rows(
            tables,
            [r.output_ids[-1] for r in batch],
            [r.next_position for r in batch],
            self.block_table.rows([r.slot for r in batch], tables),
        )
        # The structured rows' masks: on a helper thread while the forward runs (both release
        # the GIL), taken before the matchers move again.
        masks = self.grammars.start_masks([r.grammar for r in batch])
        return StartedStep(batch, fb, masks, time.monotonic())

    def _finish_step(
        self, step: StartedStep, logits: torch.Tensor | None, error: Exception | None
    ) -> Outputs:
        """The step's outputs and logprobs from its forward's logits (or exception). Rows whose
        request left while it ran (aborted, expired: overlap only) are dropped first."""
        masks = step.masks.result()
        batch = [r for r in step.batch if r.state == DecodeState.RUNNING]
        if error is not None:
            self.fail_forward(batch, error)
            return [], None
        if len(batch) < len(step.batch):
            keep = [i for i, r in enumerate(step.batch) if r.state == DecodeState.RUNNING]
            logits, masks = logits[keep], (None if masks is None else masks.select(keep))
        tokens = self.sample_tokens(logits, batch, masks)
        for request, token in zip(batch, tokens, strict=True):
            self.advance_grammar(request, token)
        logprobs = token_logprobs(logits, tokens, [r.params.logprobs for r in batch])
        logprobs_of = {r.request_id: [lp] for r, lp in zip(batch, logprobs, strict=True) if lp}
        self._record_step(batch, time.monotonic() - step.started)
        return self.scheduler.update(batch, tokens), logprobs_of

    def fail_forward(self, batch: list[DecodeRequest], exc: Exception) -> None:
        """Fails the batch's requests loudly and keeps serving the others (fatal on a
        multi-rank node, whose collectives would no longer match)."""
        if self.forward_errors_are_fatal:
            raise exc
        log.exception("decode forward failed")
        for request in batch:
            self.scheduler.abort(request.request_id)
            self.report_error(request.request_id, "decode", f"decode forward failed: {exc}")

    def _record_step(self, batch: list[DecodeRequest], elapsed: float) -> None:
        """The step's time for the stage figures and this node's step-time model (SLA)."""
        self.stage_times.add("decode_step", elapsed)
        total_context = sum(r.next_position + 1 for r in batch)
        self.step_cost.observe(len(batch), total_context, elapsed)
        self.timing_samples.add(len(batch), total_context, elapsed)

    def batch_cap(self) -> int | None:
        """The largest running batch whose predicted step (this node's own step-time model, at
        the mean context of the requests that would run) stays within tpot_ms; None without
        an SLA. At least 1: a single request always runs, however slow its steps."""
        if self.tpot_s is None:
            return None
        runnable = (DecodeState.READY, DecodeState.RUNNING)
        contexts = [r.next_position + 1 for r in self.scheduler.requests if r.state in runnable]
        if not contexts:
            return None
        mean_context = sum(contexts) / len(contexts)
        upper = self.scheduler.max_batch
        return self.step_cost.max_batch_within(self.tpot_s, mean_context, upper)

    def sample_tokens(
        self, logits: torch.Tensor, batch: list[DecodeRequest], masks: TokenMasks | None = None
    ) -> list[int]:
        """The step's tokens. The penalties read the output counts kept by batch slot: a row is
        set when its request joins the batch and grows by each token sampled. `masks` (the
        structured rows') leave each such row only its grammar's next tokens."""
        counts, params = self.token_counts, [r.params for r in batch]
        joined = [r for r in batch if r.is_joining]
        counts.start(
            [r.slot for r in joined],
            [r.params for r in joined],
            [r.prompt_ids for r in joined],
            [r.output_ids for r in joined],
        )
        slots = [r.slot for r in batch]
        num_generated = [len(r.output_ids) for r in batch]
        past = counts.past(slots, params, num_generated, [r.stop_ids for r in batch])
        allowed = logits if masks is None else masks.apply(logits)
        # The draw index of a row is its tokens so far (P's first one included), after those of
        # its earlier attempts.
        draws = [n + p.draw_offset for n, p in zip(num_generated, params, strict=True)]
        tokens = sample(allowed, params, [r.seed for r in batch], draws, past)
        counts.add(slots, tokens)
        return tokens

    def advance_grammar(self, request: DecodeRequest, token: int) -> bool:
        """The request's grammar consumes `token`; False when it refuses it (it never should: the
        token was sampled under its mask), and the request fails then."""
        if request.grammar is None or request.grammar.consume(token):
            return True
        message = f"structured output: token {token} breaks the grammar ({request.grammar.error})"
        self.scheduler.abort(request.request_id, message)
        self.report_error(request.request_id, "decode", message)
        return False

    def _emit(
        self, outputs: list[StepOutput], logprobs_of: dict[str, list[TokenLogprobs]] | None = None
    ) -> None:
        """The step's outputs, every request in one StepTokens (not one message per request):
        with each request's logprobs (one per token it emitted) where it asked."""
        entries = []
        for out in outputs:
            lps = (logprobs_of or {}).get(out.request_id, []) if out.token_ids else []
            entries.append(
                RequestTokens(
                    out.request_id,
                    out.token_ids,
                    out.finish_reason,
                    logprobs=[lp.logprob for lp in lps],
                    top_ids=[lp.top_ids for lp in lps],
                    top_logprobs=[lp.top_logprobs for lp in lps],
                )
            )
            if out.finish_reason is not None:  # one line per request end, with its id
                log.info("request %s: finished (%s)", out.request_id, out.finish_reason)
        for msg in step_tokens_messages(entries):  # one, but for a batch past the bounds
            self.outbox.send(msg)

    def report_preempted(self) -> None:
        """Preempted for each request `schedule` dropped to find pages: after the StepTokens of
        its output (the same outbox, in order), so the router has its whole output when it
        re-prefills it."""
        for request in self.scheduler.take_preempted():
            log.info("request %s: preempted (%s)", request.request_id, request.error)
            self.outbox.send(Preempted(request.request_id, len(request.output_ids), request.error))

    def report_error(self, request_id: str, stage: str, message: str) -> None:
        log.warning("request %s: failed at %s: %s", request_id, stage, message)
        self.outbox.send(RequestError(request_id, stage, message))

    def heartbeat(self) -> Heartbeat:
        stats = self.receiver.stats()
        return Heartbeat(
            self.name,
            "decode",
            num_waiting=self.scheduler.count(DecodeState.AWAITING_KV)
            + self.scheduler.count(DecodeState.READY),
            num_running=self.scheduler.count(DecodeState.RUNNING),
            free_pages=self.scheduler.num_free_pages(),  # evictable cached pages included
            total_pages=self.pool.num_pages,
            page_size=self.pool.page_size,
            kv_bytes_received=stats.bytes_written,
            kv_rows_received=stats.bytes_written // self.pool.bytes_per_token,
            kv_chunks_dropped=stats.num_dropped,
            num_malformed=self.inbox.num_malformed,
            stage_ms=self.stage_times.means(),
            draining=self.is_draining,
            num_preempted=self.scheduler.num_preempted,
            timing_samples=self.timing_samples.take(),
            **self._mtp_figures(),
            **prefix_cache_figures(self.prefix_cache),
        )

    def _mtp_figures(self) -> dict[str, int]:
        if self.speculative is None:
            return {}
        s = self.speculative.stats
        return dict(
            mtp_drafted=s.drafted,
            mtp_accepted=s.accepted,
            mtp_emitted=s.emitted,
            mtp_request_steps=s.request_steps,
        )

    def close(self, reason: str) -> None:
        """Fails whatever is still held (the router hears of each), frees it, closes the
        receiver."""
        if self._unsent is not None:  # the last step's tokens (overlap), before the errors
            self._emit(*self._unsent)
            self._unsent = None
        if self.overlap is not None:
            self.overlap.close()
        for request in self.scheduler.requests:
            self._abort(request.request_id, reason)
            self.report_error(request.request_id, "decode", reason)
        self.receiver.close()
        self.grammars.close()


def _rendezvous(request: DecodeRequest) -> Rendezvous:
    return Rendezvous(request.request_id, request.room)
