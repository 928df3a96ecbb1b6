"""Output text of one request: incremental detokenization, then stop strings.

Text that might be the start of a stop string is held back until the next tokens show it is
not (or the request ends), so the client never sees part of a stop string. The detokenizer
never emits half a UTF-8 character (`control.tokenizer.IncrementalDetokenizer`).
"""

from __future__ import annotations

from control.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    """Token ids in, text deltas out. `stopped` turns True when a stop string was found: the
    delta returned then ends right before it, and nothing is returned afterwards."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.stopped = False
        self._held = ""  # detokenized text that may begin a stop string

    def push(self, token_ids: list[int], is_last: bool = False) -> str:
        """Adds tokens; `is_last` flushes everything held (the request ends after them)."""
        if self.stopped:
            return ""
        new = "".join(self.detok.push(t) for t in token_ids)
        if is_last:
            new += self.detok.flush()
        return self._scan(self._held + new, is_last)

    def _scan(self, text: str, is_last: bool) -> str:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return text[: min(hits)]
        if is_last or not self.stop:
            self._held = ""
            return text
        keep = self._stop_prefix_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`: what a
    stream holds back, since the next delta may complete the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
