"""Structured output: grammar-constrained decoding with llguidance.

A request asks for it with `SamplingParams.structured = (kind, spec)`:
  json_object  any JSON object (spec "")      json_schema  a JSON schema (spec: its JSON text)
  regex        a regular expression (Rust)    choice       one of a JSON list of strings
  grammar      a Lark grammar (llguidance's dialect)

The sampling node keeps one `GrammarMatcher` per sequence: before each token, the matcher's
mask (the tokens the grammar allows next) sets every other logit to -inf; after it, the matcher
consumes the sampled token. EOS is allowed only where the grammar is complete, and once nothing
but EOS can follow it is the only token left: the request ends with finish_reason "stop"
(`SamplingParams.stop_ids` keeps EOS a stop token even with ignore_eos, so a complete grammar
never runs on). Tokens the tokenizer lacks (a model vocabulary padded past it) are never
allowed.

JSON comes without free whitespace (separators ", " and ": "): free whitespace lets a weak model
pad forever without closing the object. A schema may override that with llguidance's
`x-guidance` options.

Masks of a batch are computed in parallel by llguidance's executor (GIL released), and turned
into an additive 0 / -inf bias in torch; both can run on a helper thread while the forward runs
(`Grammars.start_masks`, from MIN_OVERLAP_ROWS rows), leaving one add on the sampling path. The
apply is plain torch: llguidance.torch's is torch.compile'd (seconds to import and compile).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance as llg
import torch

from engine.errors import InvalidRequestError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# The largest spec of each kind a request may carry (characters): a schema or grammar this big
# is already far past anything hand-written; the compile cost grows with it.
MAX_SPEC_CHARS = {
    "json_object": 0,
    "json_schema": 64 * 1024,
    "regex": 4 * 1024,
    "choice": 64 * 1024,
    "grammar": 64 * 1024,
}
MAX_CHOICES = 1024
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_ERROR_CHARS = 500
MASK_THREADS = 2  # llguidance's workers per node: a step's masks take ~0.02 ms a row
MIN_OVERLAP_ROWS = 8  # constrained rows from which a step's masks go to the helper thread


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: `kind` (one of KINDS) and its `spec` text."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"structured output: unknown kind {self.kind!r} (one of {', '.join(KINDS)})"
            )
        if not isinstance(self.spec, str):
            raise InvalidRequestError(f"structured output: the {self.kind} must be text")
        limit = MAX_SPEC_CHARS[self.kind]
        if len(self.spec) > limit:
            raise InvalidRequestError(
                f"structured output: the {self.kind} has {len(self.spec)} characters; "
                f"at most {limit} are accepted"
            )

    @classmethod
    def of(cls, value: StructuredOutput | Sequence[str]) -> StructuredOutput:
        """From SamplingParams' (kind, spec) pair."""
        return value if isinstance(value, StructuredOutput) else cls(*value)

    def grammar(self) -> str:
        """The llguidance grammar; InvalidRequestError when the spec is not even well formed
        (the grammar's own errors show when it is compiled, `Grammars.check`)."""
        if self.kind == "json_object":
            return _json_grammar({"type": "object"})
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as exc:
                raise self.error(f"not valid JSON ({exc})") from None
            if not isinstance(schema, (dict, bool)):
                raise self.error("a JSON schema must be an object")
            return _json_grammar(schema)
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            return llg.LLMatcher.grammar_from_lark(_choice_lark(self))
        return llg.LLMatcher.grammar_from_lark(self.spec)

    def error(self, message: str) -> InvalidRequestError:
        return InvalidRequestError(f"structured output: invalid {self.kind}: {message}")


def _json_grammar(schema: dict | bool) -> str:
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise InvalidRequestError(f"structured output: invalid json_schema: {exc}") from None


def _choice_lark(structured: StructuredOutput) -> str:
    """`start: "a" | "b"`: each choice a Lark string literal (JSON escapes)."""
    try:
        choices = json.loads(structured.spec)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not all(isinstance(c, str) and c for c in choices):
        raise structured.error("must be a list of non-empty strings")
    if not 0 < len(choices) <= MAX_CHOICES:
        raise structured.error(f"must hold 1 to {MAX_CHOICES} strings, got {len(choices)}")
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _error_text(message: str) -> str:
    """The library's error without its parser-state dump, one paragraph."""
    message = message.split("\n<state>", 1)[0].strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


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


class Grammars:
    """Grammars over one model's vocabulary: compiles and checks specs, makes matchers, and
    computes a step's masks (at once, or on a helper thread while the forward runs).

    The tokenizer (`tokenizer.json` of `model_dir`) is loaded on the first structured request:
    nodes that never see one never pay for it. `vocab_size` is the model's (its logits' width);
    `eos_ids` the tokens that end a complete output."""

    def __init__(
        self,
        model_dir: str | Path | None,
        vocab_size: int,
        eos_ids: Sequence[int],
        num_threads: int = MASK_THREADS,
    ):
        self.model_dir = None if model_dir is None else Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.num_threads = max(1, min(num_threads, os.cpu_count() or 1))
        self._tokenizer: llg.LLTokenizer | None = None
        self._executor: llg.LLExecutor | None = None
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _load_tokenizer(self) -> llg.LLTokenizer:
        path = None if self.model_dir is None else self.model_dir / "tokenizer.json"
        if path is None or not path.is_file():
            raise InvalidRequestError(
                "structured output is unavailable: the model has no tokenizer.json"
            )
        text = path.read_text(encoding="utf-8")
        eos = self.eos_ids or None
        try:
            tok = llg.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
        except ValueError:  # the tokenizer has more tokens than the model: mask them all off
            tok = llg.LLTokenizer(text, eos_token=eos)
        return tok

    @property
    def executor(self) -> llg.LLExecutor:
        if self._executor is None:
            self._executor = llg.LLExecutor(self.num_threads)
        return self._executor

    def check(self, structured: StructuredOutput | Sequence[str]) -> None:
        """InvalidRequestError with the reason when the spec does not compile."""
        spec = StructuredOutput.of(structured)
        error = llg.LLMatcher.validate_grammar(spec.grammar(), self.tokenizer)
        if error:
            raise spec.error(_error_text(error))

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
