"""router.reasoning: DeepSeek-R1's `<think>` split, whole and streamed in every split, against a
plain reading of the format (the oracle below)."""

import itertools

import pytest

from router.reasoning import ReasoningSplitter, split_reasoning


def oracle(text: str) -> tuple[str, str]:
    """The format read plainly: an optional opening tag (after whitespace), reasoning up to the
    first closing tag, the rest is the answer; never closed: all reasoning."""
    body = text.lstrip()
    body = body[len("<think>") :] if body.startswith("<think>") else text
    reasoning, sep, content = body.partition("</think>")
    return (reasoning, content) if sep else (body, "")


CASES = [
    "<think>\nfirst I add 2 and 2\n</think>\n\nThe answer is 4.",
    "no opening tag: the template opened it</think>answer",
    "still thinking when the tokens ran out",
    "<think></think>straight to the answer",
    "</think>",
    "",
    "  <think>lead space</think> tail",
    "a < b and </thin is not a tag</think>done </think> again",
    "<thinking is not the tag</think>x",
    "ends with a partial tag </thi",
]


@pytest.mark.parametrize("text", CASES)
def test_whole_output(text):
    assert split_reasoning(text, "deepseek_r1") == oracle(text)


@pytest.mark.parametrize("text", CASES)
def test_every_two_and_three_way_split_streams_the_same(text):
    cuts = range(len(text) + 1)
    for points in itertools.chain(itertools.combinations(cuts, 1), itertools.combinations(cuts, 2)):
        bounds = [0, *points, len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        splitter = ReasoningSplitter("deepseek_r1")
        parts = [splitter.push(p, is_last=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        reasoning = "".join(r for r, _ in parts)
        content = "".join(c for _, c in parts)
        assert (reasoning, content) == oracle(text), pieces


def test_one_character_at_a_time_keeps_the_order_and_holds_only_tag_starts():
    text = "<think>a</think>b"
    splitter = ReasoningSplitter("deepseek_r1")
    out = [splitter.push(ch) for ch in text] + [splitter.push("", is_last=True)]
    assert [(r, c) for r, c in out if r or c] == [("a", ""), ("", "b")]
    assert not splitter.in_reasoning


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="deepseek_r1"):
        ReasoningSplitter("qwen3")
