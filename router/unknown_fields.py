"""Unknown top-level request fields: ignored, as vLLM ignores them, unless ignoring one would
change what the client asked for.

vLLM accepts any field its schema lacks and logs that it was ignored. So does this gateway: the
names come back in the `x-duet-ignored-fields` response header (percent-encoded, comma
separated) and in a debug log line. The exception is `NOT_IMPLEMENTED`: fields of the OpenAI or
vLLM APIs this server knows but does not implement. At its "off" value such a field is ignored
like any other (the result is the same); any other value is a 400 naming the field, since
ignoring it would change the result (another sampling, another prompt, a missing part of the
response).

A field of the endpoint's own schema (router.api) never comes here: the schema validates it and
`check_common` refuses its unsupported values. So a field moves out of this table by being
added to the schema.

Each entry has a kind; a request model refuses the kinds in its `refused_kinds` and ignores the
rest (a sampling field means nothing to /tokenize, a chat template nothing to a raw prompt).
"""

from __future__ import annotations

import urllib.parse
from typing import Any

IGNORED_FIELDS_HEADER = "x-duet-ignored-fields"
MAX_HEADER_CHARS = 1000

SAMPLING, OUTPUT, PROMPT, CHAT = "sampling", "output", "prompt", "chat"
GENERATION_KINDS = frozenset({SAMPLING, OUTPUT, PROMPT})

# field -> (kind, the values that mean "off", why it is refused otherwise)
NOT_IMPLEMENTED: dict[str, tuple[str, tuple[Any, ...], str]] = {
    # sampling (vLLM's extensions and the other endpoint's fields)
    "max_completion_tokens": (SAMPLING, (None,), "use max_tokens on /v1/completions"),
    "best_of": (SAMPLING, (None, 1), "best_of is only supported on /v1/completions"),
    "use_beam_search": (SAMPLING, (None, False), "beam search is not supported"),
    "length_penalty": (SAMPLING, (None, 1), "beam search is not supported"),
    "allowed_token_ids": (SAMPLING, (None,), "allowed_token_ids is not supported"),
    "bad_words": (SAMPLING, (None, []), "bad_words is not supported"),
    "logits_processors": (SAMPLING, (None, []), "logits processors are not supported"),
    "vllm_xargs": (SAMPLING, (None, {}), "vllm_xargs is not supported"),
    # what the response holds
    "suffix": (OUTPUT, (None, ""), "suffix is only supported on /v1/completions"),
    "return_token_ids": (OUTPUT, (None, False), "return_token_ids is not supported"),
    "include_stop_str_in_output": (OUTPUT, (None, False), "stop strings are never included"),
    "skip_special_tokens": (OUTPUT, (None, True), "special tokens are always skipped"),
    "spaces_between_special_tokens": (OUTPUT, (None, True), "this option is not supported"),
    "modalities": (OUTPUT, (None, ["text"]), "only text output is supported"),
    "audio": (OUTPUT, (None,), "only text output is supported"),
    # what the prompt is
    "truncate_prompt_tokens": (PROMPT, (None,), "prompt truncation is not supported"),
    "prompt_embeds": (PROMPT, (None,), "prompt embeddings are not supported"),
    "web_search_options": (PROMPT, (None,), "web search is not supported"),
    "chat_template": (CHAT, (None,), "only the model's own chat template is supported"),
    "documents": (CHAT, (None, []), "documents are not supported"),
    "functions": (CHAT, (None, []), "function calls are not supported"),
    "function_call": (CHAT, (None, "none"), "function calls are not supported"),
}


def refusal(name: str, value: Any, refused_kinds: frozenset[str]) -> str | None:
    """Why the unknown field `name` set to `value` is refused (the 400's message), or None when
    it is ignored: a `NOT_IMPLEMENTED` field of a refused kind set to another value than "off"."""
    kind, off, why = NOT_IMPLEMENTED.get(name, (None, (), ""))
    if kind not in refused_kinds or any(_same(value, v) for v in off):
        return None
    return (
        f"{name}: {why} (unknown fields are ignored, but ignoring this one would change the result)"
    )


def _same(value: Any, off: Any) -> bool:
    """JSON equality without Python's `True == 1` (so `"use_beam_search": 0` is not "off")."""
    if isinstance(value, bool) or isinstance(off, bool):
        return isinstance(value, bool) and isinstance(off, bool) and value == off
    return value == off


def ignored_fields_headers(ignored: list[str]) -> dict[str, str]:
    """The response header naming the ignored fields (none when nothing was ignored): each name
    percent-encoded (any text can be a JSON key; a header value cannot), at most
    MAX_HEADER_CHARS in all, cut with ",..." when longer."""
    if not ignored:
        return {}
    value = ",".join(urllib.parse.quote(name, safe="") for name in ignored)
    if len(value) > MAX_HEADER_CHARS:
        value = value[: MAX_HEADER_CHARS - 4].rsplit(",", 1)[0] + ",..."
    return {IGNORED_FIELDS_HEADER: value}
