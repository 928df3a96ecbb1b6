"""Benchmark prompts: exact token lengths (the tokenizer itself is the oracle), long-tailed
chat lengths, determinism."""

import json

import numpy as np
import pytest

from bench.datasets import (
    CHAT_TAIL,
    PromptMaker,
    lognormal_lengths,
    make_requests,
    word_token_ids,
)
from control.errors import ConfigError
from control.tokenizer import Tokenizer
from tinymodel.bench_model import BENCH_VOCAB
from tinymodel.builder import _tokenizer_config, train_tokenizer
from tinymodel.make import ensure_tiny_model


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(ensure_tiny_model())


@pytest.fixture(scope="module")
def bench_tok(tmp_path_factory):
    """The bench model's tokenizer (trained with a 32000 target), without writing weights."""
    path = tmp_path_factory.mktemp("bench-tok")
    train_tokenizer(BENCH_VOCAB).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config()))
    return Tokenizer(path)


@pytest.mark.parametrize("length", [1, 2, 19, 512, 4096 + 13])
def test_prompt_has_exact_token_length(tok, bench_tok, length):
    for tokenizer in (tok, bench_tok):
        text = PromptMaker(tokenizer, seed=length).prompt(length)
        assert len(tokenizer.encode(text)) == length
        # encode_prompt (what the server does) adds exactly the bos token.
        assert len(tokenizer.encode_prompt(text)) == length + 1


def test_word_tokens_round_trip(tok):
    ids = word_token_ids(tok)
    assert len(ids) >= 8
    for i in ids:
        text = tok.decode([i])
        assert text.startswith(" ") and text[1:].isalpha() and tok.encode(text) == [i]


def test_random_requests_are_distinct_and_deterministic(tok):
    a = make_requests(tok, "random", 16, 32, 7, seed=5)
    b = make_requests(tok, "random", 16, 32, 7, seed=5)
    c = make_requests(tok, "random", 16, 32, 7, seed=6)
    assert a == b and a != c
    assert len({r.prompt for r in a}) == 16  # no two prompts alike (no shared prefix cache)
    assert all(r.prompt_len == 32 and r.output_len == 7 for r in a)


def test_synthetic_chat_lengths_are_long_tailed():
    rng = np.random.default_rng(0)
    lengths = np.asarray(lognormal_lengths(rng, 5000, 200, 1.0, int(CHAT_TAIL * 200)))
    assert np.median(lengths) == pytest.approx(200, rel=0.1)
    assert lengths.mean() > 1.3 * np.median(lengths)  # right-skewed, like ShareGPT's
    assert lengths.max() == CHAT_TAIL * 200 and lengths.min() >= 1


def test_synthetic_chat_requests(tok):
    reqs = make_requests(tok, "synthetic-chat", 40, 24, 8, seed=1)
    assert len({r.prompt_len for r in reqs}) > 5 and len({r.output_len for r in reqs}) > 3
    for r in reqs:
        assert len(tok.encode(r.prompt)) == r.prompt_len
        assert 1 <= r.output_len <= CHAT_TAIL * 8


def test_shared_prefix_requests(tok):
    reqs = make_requests(tok, "shared-prefix", 12, 24, 8, seed=2, prefix_len=64)
    ids = [tok.encode(r.prompt) for r in reqs]
    prefix = ids[0][:64]
    for r, encoded in zip(reqs, ids, strict=True):
        assert len(encoded) == r.prompt_len > 64
        assert encoded[:64] == prefix  # every prompt starts with the same 64 tokens
    assert len({tuple(e[64:72]) for e in ids}) == len(reqs)  # and goes on differently
    with pytest.raises(ConfigError, match="prefix_len"):
        make_requests(tok, "shared-prefix", 1, 8, 1, prefix_len=0)


def test_bad_input(tok):
    with pytest.raises(ConfigError, match="unknown dataset"):
        make_requests(tok, "sharegpt", 1, 1, 1)
    with pytest.raises(ConfigError, match=">= 1"):
        make_requests(tok, "random", 1, 0, 1)
