"""control.fim: the fill-in-the-middle prompt's ids on the tiny model's byte-level BPE with the
three DeepSeek FIM tokens added as special tokens. The oracle is the `tokenizers` library itself:
its encoding of the pieces joined around the FIM tokens' ids (looked up in the saved
tokenizer.json), and its encoding of the whole FIM text (which splits at the added tokens and
adds bos through the post-processor)."""

import json
import shutil

import pytest
from tokenizers import Tokenizer as HfTokenizer

from control.errors import InvalidRequestError
from control.fim import (
    FIM_BEGIN,
    FIM_END,
    FIM_HOLE,
    FIM_TOKENS,
    FimTokenIds,
    NoFimTokensError,
    fim_prompt_ids,
    fim_token_ids,
)
from control.tokenizer import Tokenizer
from tinymodel.make import ensure_tiny_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
BPE_VOCAB = 2048  # the trained tiny model's tokenizer: ids 0..2047, the added FIM tokens next

CASES = [
    ("def add(a, b):\n    return", "\n\nprint(add(1, 2))\n"),
    ("The quick brown", " over the lazy dog."),
    ("  leading spaces and\ttabs", "trailing\n\n"),
    ("日本語 café", " 🚀 naïve résumé"),
    ("", "the middle goes first"),  # the hole at the very start of a file
    ("x = 1\n", "\n"),
]


def tokenizer_dir(path, tokens=FIM_TOKENS, add_bos_token=None):
    """The tiny model's tokenizer files in `path`, with `tokens` added as special tokens."""
    src = ensure_tiny_model()
    path.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, path / name)
    hf = HfTokenizer.from_file(str(path / "tokenizer.json"))
    assert hf.add_special_tokens(list(tokens)) == len(tokens)
    hf.save(str(path / "tokenizer.json"))
    if add_bos_token is not None:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        cfg["add_bos_token"] = add_bos_token
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def fim_dir(tmp_path_factory):
    return tokenizer_dir(tmp_path_factory.mktemp("fim") / "tok")


@pytest.fixture(scope="module")
def hf(fim_dir):
    """The oracle: the saved tokenizer.json, read by the library directly."""
    return HfTokenizer.from_file(str(fim_dir / "tokenizer.json"))


def pieces_oracle(hf, prompt, suffix, bos):
    """bos, then the library's ids of each piece (no special tokens) around the FIM tokens' ids."""
    begin, hole, end = (hf.token_to_id(t) for t in (FIM_BEGIN, FIM_HOLE, FIM_END))
    encode = lambda text: hf.encode(text, add_special_tokens=False).ids  # noqa: E731
    return [*bos, begin, *encode(prompt), hole, *encode(suffix), end]


def test_the_fim_tokens_are_found_as_their_single_ids(fim_dir, hf):
    ids = fim_token_ids(Tokenizer(fim_dir))
    # Added after the 2048-entry BPE vocabulary, in the order given.
    assert ids == FimTokenIds(BPE_VOCAB, BPE_VOCAB + 1, BPE_VOCAB + 2)
    assert [hf.id_to_token(i) for i in ids] == list(FIM_TOKENS)
    # The exact strings: fullwidth vertical bars (U+FF5C) and U+2581 between "fim" and the name.
    assert FIM_BEGIN == "<\N{FULLWIDTH VERTICAL LINE}fim\N{LOWER ONE EIGHTH BLOCK}begin\uff5c>"
    assert FIM_TOKENS == ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")


@pytest.mark.parametrize(("prompt", "suffix"), CASES)
def test_fim_ids_equal_the_library_encoding(fim_dir, hf, prompt, suffix):
    tok = Tokenizer(fim_dir)
    assert tok.add_bos_token and tok.bos_token_id == hf.token_to_id("<|begin_of_text|>") == 0
    got = fim_prompt_ids(tok, prompt, suffix, add_special_tokens=True)
    assert got == pieces_oracle(hf, prompt, suffix, bos=[0])
    # The whole FIM text through the library: it splits at the added tokens, and its
    # post-processor puts bos first (as for a plain prompt).
    whole = hf.encode(FIM_BEGIN + prompt + FIM_HOLE + suffix + FIM_END, add_special_tokens=True)
    assert got == whole.ids
    assert got[:2] == [0, BPE_VOCAB] and got[-1] == BPE_VOCAB + 2
    assert got.count(BPE_VOCAB + 1) == 1


@pytest.mark.parametrize(("prompt", "suffix"), CASES[:3])
def test_no_bos_without_add_special_tokens(fim_dir, hf, prompt, suffix):
    got = fim_prompt_ids(Tokenizer(fim_dir), prompt, suffix, add_special_tokens=False)
    assert got == pieces_oracle(hf, prompt, suffix, bos=[])
    assert got[0] == BPE_VOCAB


def test_no_bos_when_the_tokenizer_adds_none(tmp_path):
    d = tokenizer_dir(tmp_path / "tok", add_bos_token=False)
    tok = Tokenizer(d)
    assert not tok.add_bos_token
    hf = HfTokenizer.from_file(str(d / "tokenizer.json"))
    prompt, suffix = CASES[0]
    got = fim_prompt_ids(tok, prompt, suffix, add_special_tokens=True)
    assert got == pieces_oracle(hf, prompt, suffix, bos=[])
    assert got[0] == BPE_VOCAB
    # The same rule as a plain prompt: encode_prompt adds no bos either.
    assert tok.encode_prompt(prompt) == hf.encode(prompt, add_special_tokens=False).ids


def test_a_plain_prompt_and_a_fim_prompt_agree_on_bos(fim_dir):
    """bos first exactly when `encode_prompt` (Serving.encode_text's rule) puts it first."""
    tok = Tokenizer(fim_dir)
    prompt, suffix = CASES[1]
    plain = tok.encode_prompt(prompt)
    fim = fim_prompt_ids(tok, prompt, suffix)
    assert plain[0] == fim[0] == 0
    assert fim[2 : 2 + len(plain) - 1] == plain[1:]


def test_a_tokenizer_without_fim_tokens_is_refused():
    tok = Tokenizer(ensure_tiny_model())  # the built-in tiny model: no FIM tokens
    assert tok.token_to_id(FIM_BEGIN) is None
    assert fim_token_ids(tok) is None
    with pytest.raises(NoFimTokensError) as info:
        fim_prompt_ids(tok, "def f():", "\n", add_special_tokens=True)
    assert isinstance(info.value, InvalidRequestError)
    assert str(info.value) == (
        "suffix: this model has no fill-in-the-middle tokens "
        "(<｜fim▁begin｜>, <｜fim▁hole｜>, <｜fim▁end｜>)"
    )


def test_two_of_the_three_tokens_are_not_enough(tmp_path):
    tok = Tokenizer(tokenizer_dir(tmp_path / "tok", tokens=(FIM_BEGIN, FIM_HOLE)))
    assert tok.token_to_id(FIM_BEGIN) == BPE_VOCAB and tok.token_to_id(FIM_END) is None
    assert fim_token_ids(tok) is None
    with pytest.raises(NoFimTokensError, match="no fill-in-the-middle tokens"):
        fim_prompt_ids(tok, "a", "b")
