"""Grammar-constrained decoding with llguidance on the sampling nodes: matchers and masks.

The spec a request carries and its check are `control.structured_output`.
The sampling node keeps one `GrammarMatcher` per sequence: before each token, the matcher's
mask (the tokens the grammar allows next) sets every other logit to -inf; after it, the matcher
consumes the sampled token. EOS is allowed only where the grammar is complete, and once nothing
but EOS can follow it is the only token left: the request ends with finish_reason "stop"
(`SamplingParams.stop_ids` keeps EOS a stop token even with ignore_eos, so a complete grammar
never runs on). Tokens the tokenizer lacks (a model vocabulary padded past it) are never
allowed.

Masks of a batch are computed in parallel by llguidance's executor (GIL released), and turned
into an additive 0 / -inf bias in torch; both can run on a helper thread while the forward runs
(`Grammars.start_masks`, from MIN_OVERLAP_ROWS rows), leaving one add on the sampling path. The
apply is plain torch: llguidance.torch's is torch.compile'd (seconds to import and compile).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance as llg
import torch

from control.errors import InvalidRequestError
from control.structured_output import GrammarChecker, StructuredOutput, _error_text

MASK_THREADS = 2  # llguidance's workers per node: a step's masks take ~0.02 ms a row
MIN_OVERLAP_ROWS = 8  # constrained rows from which a step's masks go to the helper thread


class GrammarMatcher:
    """One sequence's place in its grammar. Not thread-safe: the mask computation may read it
    on a helper thread only while nobody consumes."""

    def __init__(self, matcher: llg.LLMatcher, mask_words: int):
        self._matcher = matcher
        self.mask_words = mask_words  # int32 words of one bitmask row

    def consume(self, token: int) -> bool:
        """Advances past `token`; False (and `error` set, for good) when the grammar refuses
        it. EOS after the grammar is complete is accepted."""
        return self._matcher.consume_token(token)

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same place (a sequence forked from this one)."""
        return GrammarMatcher(self._matcher.deep_copy(), self.mask_words)

    @property
    def is_finished(self) -> bool:
        """Nothing but EOS can follow (the grammar is complete), or the matcher failed."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS is allowed next)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str:
        return _error_text(self._matcher.get_error()) if self._matcher.is_error() else ""

    def bitmask(self) -> torch.Tensor:
        """[mask_words] int32: bit t % 32 of word t // 32 set when token t is allowed next
        (the library's single-matcher path, for tests)."""
        raw = bytearray(self._matcher.compute_bitmask())
        return torch.frombuffer(raw, dtype=torch.int32).clone()


# BYTE_BIAS[b, j] = 0 if bit j of byte b is set, else -inf: one gather turns a bitmask (read
# as bytes, little-endian) into a bias over the vocabulary, faster than shifts or masked_fill.
_BYTE_BITS = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # [256, 8]
BYTE_BIAS = torch.zeros(256, 8).masked_fill_(_BYTE_BITS == 0, float("-inf"))


@dataclass(frozen=True)
class TokenMasks:
    """The masks of a step's constrained rows: `rows` (indices into the step's batch) and their
    `bias` [R, V] fp32 (0 where allowed, -inf elsewhere)."""

    rows: list[int]
    bias: torch.Tensor

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> a new [B, V] with the disallowed tokens of the rows at -inf
        (`logits` itself is left as the model gave it: logprobs are the model's)."""
        if len(self.rows) == logits.shape[0]:
            return logits + self.bias
        out = logits.clone()
        out[self.rows] += self.bias
        return out

    def select(self, keep: list[int]) -> TokenMasks | None:
        """The masks of the batch rows `keep` (indices, in the new batch's order), renumbered
        to that batch; None when none of them is constrained."""
        new_row = {old: new for new, old in enumerate(keep)}
        picked = [(new_row[row], i) for i, row in enumerate(self.rows) if row in new_row]
        if not picked:
            return None
        return TokenMasks([row for row, _ in picked], self.bias[[i for _, i in picked]])


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [R, W] int32 (bit t % 32 of word t // 32: token t allowed) -> [R, vocab_size]
    fp32 bias, 0 where allowed and -inf elsewhere."""
    num_rows = bitmask.shape[0]
    by_byte = bitmask.contiguous().view(torch.uint8).reshape(-1).long()  # [R * 4W] little-endian
    # index_select: several times faster than advanced indexing for this gather on CPU.
    bias = BYTE_BIAS.index_select(0, by_byte)  # [R * 4W, 8]
    return bias.view(num_rows, -1)[:, :vocab_size]  # [R, 32W] -> [R, V]


def compute_masks(
    matchers: Sequence[GrammarMatcher | None], vocab_size: int, executor: llg.LLExecutor
) -> TokenMasks | None:
    """The masks of the rows that have a matcher (None: no row has one), computed in parallel.
    A matcher on several rows (sequences sampled from one state) is computed once."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    first_row: dict[int, int] = {}  # id(matcher) -> its first index into `rows`
    for k, row in enumerate(rows):
        first_row.setdefault(id(matchers[row]), k)
    words = matchers[rows[0]].mask_words
    bitmask = torch.empty(len(rows), words, dtype=torch.int32)
    # What llguidance.torch.fill_next_token_bitmask_par does, without importing that module
    # (it torch.compiles its apply at import). Row k of `bitmask` is written for rows[k].
    targets = [(matchers[rows[k]]._matcher, k) for k in first_row.values()]
    executor.unsafe_compute_mask_ptr(targets, bitmask.data_ptr(), words * 4, len(rows))
    if len(targets) < len(rows):
        source = torch.tensor([first_row[id(matchers[row])] for row in rows])
        bitmask = bitmask[source]
    return TokenMasks(rows, bitmask_bias(bitmask, vocab_size))


def apply_masks(
    logits: torch.Tensor,
    matchers: Sequence[GrammarMatcher | None],
    executor: llg.LLExecutor | None = None,
) -> torch.Tensor:
    """logits [B, V] -> logits with each constrained row's disallowed tokens at -inf (a new
    tensor), or `logits` itself when no row has a matcher."""
    masks = compute_masks(matchers, logits.shape[1], executor or _shared_executor())
    return logits if masks is None else masks.apply(logits)


@functools.cache
def _shared_executor() -> llg.LLExecutor:
    return llg.LLExecutor(MASK_THREADS)


class Grammars(GrammarChecker):
    """Grammars over one model's vocabulary on a sampling node: besides `check`, makes matchers
    and computes a step's masks (at once, or on a helper thread while the forward runs)."""

    def __init__(
        self,
        model_dir: str | Path | None,
        vocab_size: int,
        eos_ids: Sequence[int],
        num_threads: int = MASK_THREADS,
    ):
        super().__init__(model_dir, vocab_size, eos_ids)
        self.num_threads = max(1, min(num_threads, os.cpu_count() or 1))
        self._executor: llg.LLExecutor | None = None
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def executor(self) -> llg.LLExecutor:
        if self._executor is None:
            self._executor = llg.LLExecutor(self.num_threads)
        return self._executor

    def matcher(self, structured: StructuredOutput | Sequence[str]) -> GrammarMatcher:
        """A matcher at the grammar's start; InvalidRequestError when the spec does not
        compile."""
        spec = StructuredOutput.of(structured)
        matcher = llg.LLMatcher(self.tokenizer, spec.grammar(), log_level=0)
        if matcher.is_error():
            raise spec.error(_error_text(matcher.get_error()))
        return GrammarMatcher(matcher, (self.tokenizer.vocab_size + 31) // 32)

    def matcher_for(
        self, structured: Sequence[str] | None, replay: Sequence[int] = ()
    ) -> GrammarMatcher | None:
        """`matcher` past the `replay` tokens (the output a restarted attempt streamed before),
        or None for a request without structured output; InvalidRequestError when the spec
        does not compile or the grammar refuses the replayed output."""
        if structured is None:
            return None
        matcher = self.matcher(structured)
        for token in replay:
            if not matcher.consume(token):
                raise InvalidRequestError(
                    f"structured output: the output to resume from breaks the grammar "
                    f"({matcher.error})"
                )
        return matcher

    def compute_masks(self, matchers: Sequence[GrammarMatcher | None]) -> TokenMasks | None:
        return compute_masks(matchers, self.vocab_size, self.executor)

    def start_masks(
        self, matchers: Sequence[GrammarMatcher | None]
    ) -> concurrent.futures.Future[TokenMasks | None]:
        """`compute_masks` on the helper thread; the matchers must not change until the result
        is taken. Fewer than MIN_OVERLAP_ROWS constrained rows are computed at once instead:
        the thread's handoff (~0.3 ms measured, `duet bench-masks`) costs more than they do."""
        if sum(m is not None for m in matchers) < MIN_OVERLAP_ROWS:
            done: concurrent.futures.Future[TokenMasks | None] = concurrent.futures.Future()
            done.set_result(self.compute_masks(matchers))
            return done
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, "grammar-masks")
        return self._worker.submit(self.compute_masks, list(matchers))

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
