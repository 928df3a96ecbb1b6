"""Structured output as a request carries it: the spec (`StructuredOutput`) and the check that
it compiles (`GrammarChecker`), with llguidance and no torch.

A request asks for it with `SamplingParams.structured = (kind, spec)`:
  json_object  any JSON object (spec "")      json_schema  a JSON schema (spec: its JSON text)
  regex        a regular expression (Rust)    choice       one of a JSON list of strings
  grammar      a Lark grammar (llguidance's dialect)

With a third item, `(kind, spec, after)`, the grammar applies only after the output's first
`after` (a reasoning model's "</think>"): the text before it is free, as a reasoning parser
reads it, and the spec constrains the answer, not the thinking. Free text ends at the first
`after`, so the reasoning cannot write it and go on thinking.

JSON comes without free whitespace (separators ", " and ": "): free whitespace lets a weak model
pad forever without closing the object. A schema may override that with llguidance's
`x-guidance` options. The sampling nodes' matchers and masks are `runtime.grammar`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance as llg

from control.errors import InvalidRequestError

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
MAX_AFTER_CHARS = 64
_REGEX_SPECIAL = frozenset("\\.+*?()|[]{}^$#&-~/")


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: `kind` (one of KINDS) and its `spec` text."""

    kind: str
    spec: str = ""
    after: str = ""  # the grammar starts after the output's first `after` ("": at once)

    def __post_init__(self) -> None:
        if not isinstance(self.after, str) or len(self.after) > MAX_AFTER_CHARS:
            raise InvalidRequestError(
                f"structured output: the text it starts after must be at most "
                f"{MAX_AFTER_CHARS} characters"
            )
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
        """From SamplingParams' (kind, spec) or (kind, spec, after)."""
        return value if isinstance(value, StructuredOutput) else cls(*value)

    def grammar(self) -> str:
        """The llguidance grammar; InvalidRequestError when the spec is not even well formed
        (the grammar's own errors show when it is compiled, `Grammars.check`)."""
        body = self._body_grammar()
        return _after(self.after, body) if self.after else body

    def _body_grammar(self) -> str:
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


def _after(text: str, body: str) -> str:
    """`body` (an llguidance grammar, its JSON) behind free text that ends at the first `text`:
    one lexeme, any text ending in `text` and holding it nowhere else."""
    literal = "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)
    free = f"/(?s:.*){literal}/ & ~/(?s:.*{literal}.+)/"
    grammars = _grammar_list(body)
    grammars[0]["name"] = "body"
    head = {"name": "start", "lark_grammar": f"start: FREE @body\nFREE: {free}\n"}
    return json.dumps({"grammars": [head, *grammars]})


def _grammar_list(body: str) -> list[dict]:
    """The grammars of llguidance's JSON form (a non-empty "grammars" list of objects), else
    `body` as one Lark grammar (how a malformed one fails is then Lark's error to tell)."""
    try:
        grammars = json.loads(body).get("grammars") if body.lstrip().startswith("{") else None
    except (ValueError, AttributeError):
        grammars = None
    if isinstance(grammars, list) and grammars and all(isinstance(g, dict) for g in grammars):
        return grammars
    return [{"lark_grammar": body}]


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


class GrammarChecker:
    """Checks specs against one model's vocabulary: that they compile, with llguidance's reason
    when they do not. Torch-free, for the gateway; the sampling nodes' `runtime.grammar.Grammars`
    builds on it.

    The tokenizer (`tokenizer.json` of `model_dir`) is loaded on the first structured request:
    processes that never see one never pay for it. `vocab_size` is the model's (its logits'
    width); `eos_ids` the tokens that end a complete output."""

    def __init__(self, model_dir: str | Path | None, vocab_size: int, eos_ids: Sequence[int]):
        self.model_dir = None if model_dir is None else Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._tokenizer: llg.LLTokenizer | None = None

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

    def check(self, structured: StructuredOutput | Sequence[str]) -> None:
        """InvalidRequestError with the reason when the spec does not compile."""
        spec = StructuredOutput.of(structured)
        error = llg.LLMatcher.validate_grammar(spec.grammar(), self.tokenizer)
        if error:
            raise spec.error(_error_text(error))
