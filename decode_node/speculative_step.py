"""The decode node's step with MTP speculative decoding (`mtp = true`; `runtime.speculative`).

One step over the running batch:
1. each speculating request feeds its last token and its drafts (at most `mtp_tokens`, fewer
   near max_tokens or the context's end, none when the pool has no page for them), every other
   request its last token alone, all in ONE decode-path forward of the main model;
2. the others sample exactly as without MTP (penalties, grammar masks, logprobs); a
   speculating request accepts a prefix of its drafts plus one token of the target's;
3. the scheduler appends each request's tokens up to the first that ends it;
4. the MTP layer runs once over the accepted positions of the requests still running, and
   leaves each with its next drafts.
Rejected drafts leave rows past the sequence's length: never read (attention stops at the
length), overwritten by the next step; their pages stay with the request as its next room.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from control.errors import OutOfPagesError
from decode_node.scheduler import DecodeRequest, DecodeScheduler, DecodeState
from model.deepseek import DeepseekModel
from model.kv_pool import KVPool
from runtime.block_table import BlockTable
from runtime.grammar import Grammars, TokenMasks
from runtime.logprobs import token_logprobs
from runtime.speculative import accept_tokens, draft, draftable, rows_batch

log = logging.getLogger(__name__)


@dataclass
class MtpStats:
    """Cumulative counters (heartbeats carry them to the router's /metrics)."""

    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of those, accepted
    emitted: int = 0  # tokens the speculating requests emitted (accepted + one per request-step)
    request_steps: int = 0  # (speculating request, step) pairs

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a speculating request gains per step (1.0 = no gain)."""
        return self.emitted / self.request_steps if self.request_steps else 0.0


class DecodeSteps(Protocol):
    """What the speculative step takes from its decode node: the model, its KV pool and block
    table, the scheduler and grammars, and the plain step's sampling, grammar and failure
    handling, so a speculating and a plain request sample and fail by the same rules."""

    model: DeepseekModel
    pool: KVPool
    block_table: BlockTable
    scheduler: DecodeScheduler
    grammars: Grammars
    forward_errors_are_fatal: bool

    def fail_forward(self, batch: list[DecodeRequest], exc: Exception) -> None: ...

    def sample_tokens(
        self, logits: torch.Tensor, batch: list[DecodeRequest], masks: TokenMasks | None
    ) -> list[int]: ...

    def advance_grammar(self, request: DecodeRequest, token: int) -> bool: ...


class SpeculativeStep:
    def __init__(self, node: DecodeSteps, num_draft: int):
        self.node = node
        self.num_draft = num_draft
        self.stats = MtpStats()
        self._floor = 0  # free pages draft rows must leave: one per running request
        # An expert-parallel node's exchanges (decode_node.expert_parallel): every rank makes
        # the same number of MTP exchanges a step, drafting or not.
        self.ep = None

    def run(self, batch: list[DecodeRequest]) -> tuple[list, dict, int] | None:
        """Steps 1-4 for `batch`. Returns (outputs, logprobs by request id, rows run) for the
        node to emit, or None when the forward failed (the node failed the batch)."""
        node = self.node
        spec = [draftable(r.params) for r in batch]
        self._floor = len(batch)
        for r, s in zip(batch, spec, strict=True):
            r.drafts = self._room_for_drafts(r) if s else []
        tokens = [[r.output_ids[-1], *r.drafts] for r in batch]
        positions = [r.next_position for r in batch]
        tables, slots = [r.table for r in batch], [r.slot for r in batch]
        fb = rows_batch(node.pool, tables, tokens, positions, node.block_table, slots)
        plain = [r for r, s in zip(batch, spec, strict=True) if not s]
        pending_masks = node.grammars.start_masks([r.grammar for r in plain])
        try:
            logits, hidden = node.model.forward_with_hidden(fb, node.pool)
        except Exception as exc:
            node.fail_forward(batch, exc)
            return None
        finally:
            masks = pending_masks.result()
        starts = [0]
        for t in tokens:
            starts.append(starts[-1] + len(t))
        rows_of = [range(starts[i], starts[i + 1]) for i in range(len(batch))]
        plain_rows = [rows_of[i][0] for i, s in enumerate(spec) if not s]
        emitted: list[list[int]] = [[] for _ in batch]
        logprobs_of = {}
        if plain:
            plain_logits = logits[plain_rows]
            sampled = node.sample_tokens(plain_logits, plain, masks)
            lps = token_logprobs(plain_logits, sampled, [r.params.logprobs for r in plain])
            index = [i for i, s in enumerate(spec) if not s]
            for i, r, token, lp in zip(index, plain, sampled, lps, strict=True):
                emitted[i] = [token] if node.advance_grammar(r, token) else []
                if lp and emitted[i]:
                    logprobs_of[r.request_id] = [lp]  # one per emitted token
        stats = self.stats
        for i, r in enumerate(batch):
            if spec[i]:
                emitted[i] = accept_tokens(
                    logits[rows_of[i]],
                    r.drafts,
                    r.params,
                    r.seed,
                    len(r.output_ids) + r.params.draw_offset,
                )
                stats.drafted += len(r.drafts)
                stats.accepted += len(emitted[i]) - 1
                stats.emitted += len(emitted[i])
                stats.request_steps += 1
        outputs = node.scheduler.update_many(batch, emitted)
        self._draft_next(batch, spec, emitted, positions, rows_of, hidden)
        if self.ep is not None:
            self.ep.finish_mtp_step()
        return outputs, logprobs_of, fb.num_seqs

    def _room_for_drafts(self, request: DecodeRequest) -> list[int]:
        """The request's drafts this step can verify: what max_tokens and the context leave
        after one more token, and what the pool holds (no preemption for a draft)."""
        pos = request.next_position
        room = min(
            request.params.max_new_tokens - len(request.output_ids),
            self.node.model.cfg.max_position_embeddings - 1 - pos,
        )
        drafts = request.drafts[: max(0, min(self.num_draft, room - 1))]
        return drafts if self._reserve(request, pos + len(drafts) + 1) else []

    def _reserve(self, request: DecodeRequest, num_tokens: int) -> bool:
        """Pages for a request's draft rows, only while a page per running request stays free
        after them: drafts never make the next steps' growth preempt anyone."""
        pool = self.node.pool
        need = request.table.pages_needed(num_tokens)
        if need and pool.allocator.num_free - need < self._floor:
            return False
        try:
            pool.reserve(request.table, num_tokens)
        except OutOfPagesError:
            return False
        return True

    def _draft_next(self, batch, spec, emitted, positions, rows_of, hidden: torch.Tensor) -> None:
        """Step 4: the MTP layer over each still-running speculating request's accepted
        positions; their next drafts (fewer when the context ends, or the pool is short)."""
        max_pos = self.node.model.cfg.max_position_embeddings
        live, num_next = [], []
        for i, r in enumerate(batch):
            if not spec[i] or r.state != DecodeState.RUNNING:
                continue
            end = positions[i] + len(emitted[i])  # the next step's position
            n = max(0, min(self.num_draft, max_pos - 1 - end))
            if n > 1 and not self._reserve(r, end + n):
                n = 1
            live.append(i)
            num_next.append(n)
        if not live:
            return
        rows = torch.tensor([j for i in live for j in rows_of[i][: len(emitted[i])]])
        try:
            drafts = draft(
                self.node.model,
                self.node.pool,
                [batch[i].table for i in live],
                [emitted[i] for i in live],
                [positions[i] for i in live],
                hidden[rows],
                num_next,
                self.node.block_table,
                [batch[i].slot for i in live],
            )
        except Exception:  # no drafts costs speed, never correctness: keep serving
            if self.node.forward_errors_are_fatal:  # the ranks' exchanges no longer match
                raise
            log.exception("MTP draft forward failed; these requests decode without drafts")
            drafts = [[] for _ in live]
        for i, d in zip(live, drafts, strict=True):
            batch[i].drafts = d
