"""The OpenAI shapes of logprobs: token ids and their `TokenLogprobs` -> response JSON.

Completions (`logprobs: k`): `{tokens, token_logprobs, top_logprobs, text_offset}`, each
top_logprobs entry a `{token text: logprob}` of the k most likely tokens plus the chosen one;
two ids of one text (byte pieces of a character) keep the likelier's value; with `echo` the
prompt's tokens come first, the very first with logprob and top null. Chat
(`logprobs: true, top_logprobs: k`): `{content: [{token, logprob, bytes, top_logprobs: [...]}]}`
with exactly k alternatives. A token's text is the decode of that one id (special tokens kept);
a byte-level token that holds part of a character decodes to U+FFFD, its `bytes` (chat) are the
UTF-8 of that text. Values below -9999 (an impossible token) are clamped there, as vLLM does,
since JSON has no -inf.
"""

from __future__ import annotations

from typing import Any

from control.logprobs import TokenLogprobs
from control.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0


class LogprobFormatter:
    """Formats the logprobs of one choice; keeps the text offset across streamed chunks.
    `num_top`: the alternatives shown per token (None: all that came; the prompt's may come
    with more, when `prompt_logprobs` asked for more than `echo` shows)."""

    def __init__(
        self, tokenizer: Tokenizer, chat: bool, text_offset: int = 0, num_top: int | None = None
    ):
        self.tokenizer = tokenizer
        self.chat = chat
        self.text_offset = text_offset
        self.num_top = num_top

    def _top(self, lp: TokenLogprobs) -> zip:
        n = self.num_top
        ids, values = (
            (lp.top_ids, lp.top_logprobs) if n is None else (lp.top_ids[:n], lp.top_logprobs[:n])
        )
        return zip(ids, values, strict=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def format(self, ids: list[int], logprobs: list[TokenLogprobs | None]) -> dict[str, Any]:
        """The logprobs of these tokens (ids and logprobs aligned; None: no logprob, the first
        echoed prompt token)."""
        return self._chat(ids, logprobs) if self.chat else self._completion(ids, logprobs)

    def _completion(self, ids: list[int], logprobs: list[TokenLogprobs | None]) -> dict[str, Any]:
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token, lp in zip(ids, logprobs, strict=True):
            text = self.token_text(token)
            out["tokens"].append(text)
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(text)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top: dict[str, float] = {}
            for t, v in self._top(lp):
                top.setdefault(self.token_text(t), _clamp(v))  # ids of one text: the likelier
            top.setdefault(text, _clamp(lp.logprob))
            out["token_logprobs"].append(_clamp(lp.logprob))
            out["top_logprobs"].append(top)
        return out

    def _chat(self, ids: list[int], logprobs: list[TokenLogprobs | None]) -> dict[str, Any]:
        content = []
        for token, lp in zip(ids, logprobs, strict=True):
            if lp is None:
                continue
            top = [self._entry(t, v) for t, v in self._top(lp)]
            content.append({**self._entry(token, lp.logprob), "top_logprobs": top})
        return {"content": content}

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}


def prompt_logprobs(
    tokenizer: Tokenizer, prompt_ids: list[int], logprobs: list[TokenLogprobs] | None, k: int
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: null for the first prompt token (nothing precedes it), then per
    token `{id: {logprob, rank, decoded_token}}` of the token itself and its k most likely
    alternatives (an alternative's rank is its place); None when they did not come."""
    if logprobs is None:
        return None

    def entry(token: int, logprob: float, rank: int) -> dict[str, Any]:
        text = tokenizer.decode([token], skip_special_tokens=False)
        return {"logprob": _clamp(logprob), "rank": rank, "decoded_token": text}

    out: list[dict[str, Any] | None] = [None]
    for token, lp in zip(prompt_ids[1:], logprobs, strict=False):
        shown = {str(token): entry(token, lp.logprob, lp.rank)}
        for place, (t, v) in enumerate(zip(lp.top_ids[:k], lp.top_logprobs[:k], strict=True)):
            shown.setdefault(str(t), entry(t, v, place + 1))
        out.append(shown)
    return out


def merge(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The logprobs of several chunks of one choice as one (None when there are none)."""
    if not parts:
        return None
    out: dict[str, list] = {key: [] for key in parts[0]}
    for part in parts:
        for key, values in part.items():
            out[key].extend(values)
    return out


def _clamp(value: float) -> float:
    return max(value, MIN_LOGPROB)
