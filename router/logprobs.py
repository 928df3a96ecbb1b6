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
    """Formats the logprobs of one choice; keeps the text offset across streamed chunks."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, text_offset: int = 0):
        self.tokenizer = tokenizer
        self.chat = chat
        self.text_offset = text_offset

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
            for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
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
            top = [self._entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
            content.append({**self._entry(token, lp.logprob), "top_logprobs": top})
        return {"content": content}

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}


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
