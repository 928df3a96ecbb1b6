"""Reasoning content: a reasoning model's thinking, split from its answer for the chat API's
`reasoning_content` (vLLM's and DeepSeek's field).

`deepseek_r1` (`[router] reasoning_parser`): the output is `<think>` reasoning `</think>` answer.
DeepSeek-R1's chat template opens `<think>` in the prompt itself, so an output without the
opening tag is reasoning from its first character; an output that never closes it is reasoning
to its end (it ran out of tokens while thinking), as vLLM's parser reads it.

Streamed, a tag may arrive split over deltas: text that could still be the start of a tag is
held back (a few characters at most) until the next delta or the end decides it.
"""

from __future__ import annotations

from dataclasses import dataclass

from control.cluster_config import REASONING_PARSERS
from router.text import partial_marker


@dataclass(frozen=True)
class Tags:
    start: str
    end: str


TAGS = {"deepseek_r1": Tags("<think>", "</think>")}


class ReasoningSplitter:
    """One choice's output, pushed in order: each push returns its (reasoning, content) parts."""

    def __init__(self, parser: str):
        if parser not in TAGS:
            names = ", ".join(REASONING_PARSERS)
            raise ValueError(f"unknown reasoning parser {parser!r} (one of {names})")
        self.tags = TAGS[parser]
        self.in_reasoning = True
        self._at_start = True  # the opening tag may come first (else it was in the prompt)
        self._held = ""

    def push(self, text: str, is_last: bool = False) -> tuple[str, str]:
        text = self._held + text
        self._held = ""
        reasoning = ""
        if self.in_reasoning:
            if self._at_start:
                stripped = text.lstrip()
                if self.tags.start.startswith(stripped) and not is_last:
                    self._held = text  # whitespace, or a start of the opening tag: undecided
                    return "", ""
                if stripped.startswith(self.tags.start):
                    text = stripped[len(self.tags.start) :]
                self._at_start = False
            end = text.find(self.tags.end)
            if end < 0:
                keep = 0 if is_last else partial_marker(text, self.tags.end)
                reasoning, self._held = text[: len(text) - keep], text[len(text) - keep :]
                return reasoning, ""
            reasoning, text = text[:end], text[end + len(self.tags.end) :]
            self.in_reasoning = False
        return reasoning, text


def split_reasoning(text: str, parser: str) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    return ReasoningSplitter(parser).push(text, is_last=True)
