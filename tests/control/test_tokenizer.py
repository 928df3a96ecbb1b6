"""Tokenizer and incremental detokenizer on the tiny model's byte-level BPE; transformers'
tokenizer and chat-template rendering are the oracle."""

import json
import random
import re
import shutil

import pytest

from control.errors import ConfigError
from control.tokenizer import IncrementalDetokenizer, Tokenizer
from tinymodel.builder import BOS, EOS
from tinymodel.make import make_tiny_model

TEXTS = [
    "Hello, world! The quick brown fox.",
    "She ordered a café au lait; a naïve résumé.",
    "日本語のテキスト、中文也可以。",
    "Emoji 😀🚀❤️ and math x² ≈ √2, music 𝄞, combining e\u0301.",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "digits 3.14159 and 1,024 (+46%) at 10:30",
]

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi, café?"},
    {"role": "assistant", "content": "Oui."},
    {"role": "user", "content": "日本語?"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def hf_tok(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def test_special_ids(tok):
    assert tok.bos_token_id == tok._tok.token_to_id(BOS)
    assert tok.eos_token_ids == [tok._tok.token_to_id(EOS)]
    assert tok.add_bos_token
    assert 256 < tok.vocab_size <= 512


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_matches_transformers(tok, hf_tok, text):
    ids = tok.encode_prompt(text)
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert ids == hf_tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == BOS + text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_multibyte_characters_split_across_tokens(tok):
    """The corpus is small, so some characters must span several byte tokens (the case the
    detokenizer exists for)."""
    ids = tok.encode("𝄞 😀 日本語")
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_chat_template_matches_transformers(tok, hf_tok):
    rendered = tok.apply_chat_template(CHAT)
    assert rendered == (
        f"{BOS}<|system|>Be brief.\n<|user|>Hi, café?\n<|assistant|>Oui.{EOS}"
        "<|user|>日本語?\n<|assistant|>"
    )
    assert rendered == hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    no_prompt = tok.apply_chat_template(CHAT, add_generation_prompt=False)
    assert no_prompt == rendered.removesuffix("<|assistant|>")


def test_encode_chat_has_one_bos_and_special_tokens(tok):
    ids = tok.encode_chat(CHAT)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    for special in ("<|system|>", "<|user|>", "<|assistant|>", EOS):
        assert tok._tok.token_to_id(special) in ids
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(CHAT)


def test_chat_template_raise_exception(tok):
    with pytest.raises(ValueError, match="unknown chat role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


# ---- incremental detokenizer --------------------------------------------------------------------
def _stream(tok, ids, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_on_text(tok, text):
    ids = tok.encode_prompt(text) + tok.eos_token_ids
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_detokenizer_holds_partial_character(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # one emoji, several byte tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "😀"
    assert detok.flush() == ""


def test_incremental_detokenizer_random_ids(tok):
    """Random ids (what a random model emits) include invalid byte sequences: the stream must
    still add up to the full decode, special tokens kept or skipped."""
    rng = random.Random(0)
    for trial in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        skip = trial % 2 == 0
        assert "".join(_stream(tok, ids, skip_special_tokens=skip)) == tok.decode(ids, skip), ids


def test_incremental_detokenizer_flush_unfinished(tok):
    ids = tok.encode("ok 😀")
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push(i) for i in ids[:-1])
    assert streamed == "ok "
    assert detok.flush() == tok.decode(ids[:-1])[len(streamed) :]  # the partial emoji as U+FFFD


def test_incremental_detokenizer_window_is_short(tok, monkeypatch):
    """O(1) per token: each decode call sees a few ids, not the whole history."""
    ids = tok.encode(" ".join(TEXTS) * 20)
    assert len(ids) > 1000
    sizes = []
    decode = tok.decode

    def spy(batch, skip_special_tokens=True):
        sizes.append(len(batch))
        return decode(batch, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    pieces = _stream(tok, ids)
    monkeypatch.undo()
    assert "".join(pieces) == tok.decode(ids)
    assert max(sizes) <= 8


# ---- loading --------------------------------------------------------------------------------
def test_missing_and_corrupt_files(tmp_path, model_dir):
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        Tokenizer(tmp_path)
    broken = shutil.copytree(model_dir, tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="tokenizer.json: cannot load"):
        Tokenizer(broken)
    shutil.copy(model_dir / "tokenizer.json", broken / "tokenizer.json")
    (broken / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ConfigError, match="tokenizer_config.json: cannot parse"):
        Tokenizer(broken)
    (broken / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|nope|>"}))
    with pytest.raises(ConfigError, match=re.escape("'<|nope|>' is not in tokenizer.json")):
        Tokenizer(broken)


def test_added_token_dicts_and_no_template(tmp_path, model_dir):
    """DeepSeek's tokenizer_config writes special tokens as AddedToken dicts."""
    other = shutil.copytree(model_dir, tmp_path / "other")
    (other / "generation_config.json").unlink()
    config = {
        "bos_token": {"__type": "AddedToken", "content": BOS, "special": True},
        "eos_token": {"__type": "AddedToken", "content": "<|user|>", "special": True},
        "add_bos_token": False,
    }
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(other)
    assert tok.bos_token_id == tok._tok.token_to_id(BOS)
    assert tok.eos_token_ids == [tok._tok.token_to_id("<|user|>")]
    assert tok.encode_prompt("hi") == tok.encode("hi")  # add_bos_token false
    with pytest.raises(ConfigError, match="no chat_template"):
        tok.apply_chat_template(CHAT)


# ---- continue_final_message ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "final",
    [
        {"role": "assistant", "content": "Oui, c'est"},
        {"role": "assistant", "content": "  spaces around  "},
        {"role": "assistant", "content": "text"},  # also in the end of turn, "<|end_of_text|>"
        {"role": "user", "content": "日本語"},
    ],
)
def test_continue_final_message_matches_transformers(tok, hf_tok, final):
    chat = [*CHAT, final]
    got = tok.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)
    assert got == hf_tok.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    closed = tok.apply_chat_template(chat, add_generation_prompt=False)
    assert closed.startswith(got) and got.endswith(final["content"]) and closed != got


def test_continue_final_message_of_a_template_that_trims_matches_transformers(
    tmp_path, model_dir, hf_tok
):
    other = shutil.copytree(model_dir, tmp_path / "trims")
    config = json.loads((other / "tokenizer_config.json").read_text())
    template = config["chat_template"].replace(
        "message['content'] }}", "message['content'] | trim }}"
    )
    assert template != config["chat_template"]
    config["chat_template"] = template
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    chat = [*CHAT[:2], {"role": "assistant", "content": "  Oui  "}]
    got = Tokenizer(other).apply_chat_template(chat, False, continue_final_message=True)
    assert got.endswith("<|assistant|>Oui")
    assert got == hf_tok.apply_chat_template(
        chat,
        tokenize=False,
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template=template,
    )


def test_continue_final_message_refusals(tmp_path, model_dir, tok):
    chat = [*CHAT[:2], {"role": "assistant", "content": "Oui"}]
    with pytest.raises(ValueError, match="^continue_final_message: cannot be combined"):
        tok.apply_chat_template(chat, add_generation_prompt=True, continue_final_message=True)
    for empty in ("", None):
        open_chat = [*CHAT[:2], {"role": "assistant", "content": empty}]
        with pytest.raises(ValueError, match="^continue_final_message: .* no content"):
            tok.apply_chat_template(open_chat, False, continue_final_message=True)
    other = shutil.copytree(model_dir, tmp_path / "upper")
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace(
        "message['content'] }}", "message['content'] | upper }}"
    )
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="^continue_final_message: .* does not appear"):
        Tokenizer(other).apply_chat_template(chat, False, continue_final_message=True)
