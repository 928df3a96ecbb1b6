"""TextStream: streamed text equals the tokenizer's decode of all ids (the oracle), and stop
strings cut the text exactly before their first occurrence, even across token boundaries."""

import pytest

from control.tokenizer import Tokenizer
from router.text import TextStream
from tinymodel.make import ensure_tiny_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "She ordered a café au lait; 東京は日本の首都です。 🚀 ❤️ done",
    "x² + y² = z², √2 ≈ 1.414",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(ensure_tiny_model())


def _stream(tok, ids, stop, group=1):
    ts = TextStream(tok, stop)
    parts = []
    for i in range(0, len(ids), group):
        chunk = ids[i : i + group]
        parts.append(ts.push(chunk, is_last=i + group >= len(ids)))
        if ts.stopped:
            break
    return parts, ts


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("group", [1, 3])
def test_no_stop_equals_full_decode(tok, text, group):
    ids = tok.encode(text)
    parts, ts = _stream(tok, ids, [], group)
    assert "".join(parts) == tok.decode(ids)
    assert not ts.stopped
    # no piece ever ends in a replacement character: multi-byte characters are never split
    assert all("\ufffd" not in p for p in parts)


@pytest.mark.parametrize(
    "text,stop",
    [
        (TEXTS[0], ["fox"]),
        (TEXTS[0], ["lazy dog", "brown"]),  # the earliest occurrence wins
        (TEXTS[1], ["日本"]),
        (TEXTS[0], ["q", "zzz"]),
    ],
)
def test_stop_string_cuts_before_first_occurrence(tok, text, stop):
    ids = tok.encode(text)
    full = tok.decode(ids)
    cut = min(full.find(s) for s in stop if s in full)
    parts, ts = _stream(tok, ids, stop)
    assert ts.stopped
    assert "".join(parts) == full[:cut]
    assert ts.push(ids[:1]) == ""  # nothing after the stop


def test_stop_prefix_is_held_back_then_released(tok):
    # "fox jumps" never occurs; the text "fox " must be held while it could still match
    ids = tok.encode(TEXTS[0])
    ts = TextStream(tok, ["fox jumped"])
    out = ""
    for i, t in enumerate(ids):
        out += ts.push([t], is_last=i == len(ids) - 1)
        full = tok.decode(ids[: i + 1])
        if full.endswith("fox jump"):
            assert not out.endswith("fox jump")  # held: could still become "fox jumped"
    assert out == tok.decode(ids)
    assert not ts.stopped
