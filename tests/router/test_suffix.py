"""`suffix` on /v1/completions (fill-in-the-middle, control.fim) through the real router app over
fake nodes that record what they are sent.

The built-in tiny model has no FIM tokens: a suffix there is a 400 naming `suffix`. Its
tokenizer fills its vocab_size (2048 ids, 2048 embedding rows), so a copy with the tokens added
gets ids 2048-2050, outside the model: the router refuses them like any out-of-vocabulary id.
The positive path runs on a random tiny model made with 64 spare embedding rows (vocab_size 576
over a 512-id tokenizer), its tokenizer.json given the three tokens (ids 512-514). The oracle
for the ids a node must receive is the `tokenizers` library's own encoding of the whole FIM text
`<｜fim▁begin｜>{prompt}<｜fim▁hole｜>{suffix}<｜fim▁end｜>` (bos added by its post-processor)."""

import json
import shutil

import httpx
import openai
import pytest
from router_fakes import RecordingCluster, fake_config, start_cluster, stop_all
from tokenizers import Tokenizer as HfTokenizer

from control.protocol import Prefill
from control.tokenizer import Tokenizer
from tinymodel.make import make_tiny_model

BEGIN, HOLE, END = "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"
SCRIPT = "    return a + b"
PROMPT = "def add(a, b):\n"
SUFFIX = "\n\nprint(add(1, 2))\n"
TOKENIZER_VOCAB, PADDED_VOCAB = 512, 576  # the random tiny model's tokenizer; its vocab_size


def add_fim_tokens(model_dir) -> list[int]:
    """Adds the three FIM tokens to `model_dir`'s tokenizer.json as special tokens; their ids."""
    path = str(model_dir / "tokenizer.json")
    hf = HfTokenizer.from_file(path)
    assert hf.add_special_tokens([BEGIN, HOLE, END]) == 3
    hf.save(path)
    return [hf.token_to_id(t) for t in (BEGIN, HOLE, END)]


@pytest.fixture(scope="module")
def fim_dir(tmp_path_factory):
    d = make_tiny_model(
        tmp_path_factory.mktemp("fim") / "fim-model", seed=0, overrides={"vocab_size": 576}
    )
    assert json.loads((d / "config.json").read_text())["vocab_size"] == PADDED_VOCAB
    assert add_fim_tokens(d) == [TOKENIZER_VOCAB, TOKENIZER_VOCAB + 1, TOKENIZER_VOCAB + 2]
    return d


@pytest.fixture(scope="module")
def oracle(fim_dir):
    """fim(prompt, suffix, bos=True) -> the library's ids of the whole FIM text."""
    hf = HfTokenizer.from_file(str(fim_dir / "tokenizer.json"))

    def fim(prompt, suffix, bos=True):
        return hf.encode(BEGIN + prompt + HOLE + suffix + END, add_special_tokens=bos).ids

    return fim


def _cluster(model_dir, started):
    tok = Tokenizer(model_dir)
    cfg = fake_config()
    eos = tok.eos_token_ids[0]
    fakes, server = start_cluster(
        cfg, [*tok.encode(SCRIPT), eos], eos, str(model_dir), started, RecordingCluster
    )
    return fakes, server


@pytest.fixture(scope="module")
def fim_cluster(fim_dir):
    started = []
    yield _cluster(fim_dir, started)
    stop_all(started)


@pytest.fixture(scope="module")
def plain_cluster(model_dir):
    """The built-in tiny model (no FIM tokens)."""
    started = []
    yield _cluster(model_dir, started)
    stop_all(started)


def post(server, body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=body, timeout=20)


def prefilled(fakes) -> list[list[int]]:
    return [list(m.token_ids) for m in fakes.sent(Prefill)]


def assert_refused(cluster, body, param, code, *fragments):
    fakes, server = cluster
    fakes.messages.clear()
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == code, error
    assert error["type"] == "invalid_request_error"
    for fragment in fragments:
        assert fragment in error["message"], error
    assert fakes.messages == []  # refused before any node heard of it
    return error


# ---- the FIM prompt ---------------------------------------------------------------------------
def test_the_oracle_is_the_fim_layout(oracle, fim_dir):
    """Sanity of the oracle itself: bos, begin, the prompt's ids, hole, the suffix's, end."""
    tok = Tokenizer(fim_dir)
    want = [0, 512, *tok.encode(PROMPT), 513, *tok.encode(SUFFIX), 514]
    assert oracle(PROMPT, SUFFIX) == want


def test_a_suffix_sends_the_fim_prompt(fim_cluster, oracle):
    fakes, server = fim_cluster
    fakes.messages.clear()
    r = post(server, {"prompt": PROMPT, "suffix": SUFFIX, "max_tokens": 40})
    assert r.status_code == 200, r.text
    want = oracle(PROMPT, SUFFIX)
    assert prefilled(fakes) == [want]
    out = r.json()
    assert out["usage"]["prompt_tokens"] == len(want)
    assert out["choices"][0]["text"] == SCRIPT  # the middle: the fakes' script up to EOS
    assert out["choices"][0]["finish_reason"] == "stop"


def test_the_openai_client_streams_a_fim_completion(fim_cluster, oracle):
    fakes, server = fim_cluster
    fakes.messages.clear()
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=20)
    chunks = list(
        c.completions.create(
            model="fim-model",
            prompt=PROMPT,
            suffix=SUFFIX,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    want = oracle(PROMPT, SUFFIX)
    assert prefilled(fakes) == [want]
    assert chunks[-1].usage.prompt_tokens == len(want)
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == SCRIPT


def test_each_prompt_of_a_batch_gets_the_same_suffix(fim_cluster, oracle):
    fakes, server = fim_cluster
    fakes.messages.clear()
    prompts = ["def add(a, b):\n", "x = [1, 2, 3]\n", "日本語 "]
    r = post(server, {"prompt": prompts, "suffix": SUFFIX, "max_tokens": 3})
    assert r.status_code == 200, r.text
    want = [oracle(p, SUFFIX) for p in prompts]
    assert sorted(prefilled(fakes)) == sorted(want)
    assert r.json()["usage"]["prompt_tokens"] == sum(len(w) for w in want)
    assert [ch["index"] for ch in r.json()["choices"]] == [0, 1, 2]


def test_no_bos_without_add_special_tokens(fim_cluster, oracle):
    fakes, server = fim_cluster
    fakes.messages.clear()
    body = {"prompt": PROMPT, "suffix": SUFFIX, "max_tokens": 2, "add_special_tokens": False}
    r = post(server, body)
    assert r.status_code == 200, r.text
    want = oracle(PROMPT, SUFFIX, bos=False)
    assert want[0] == 512  # begin first, no bos
    assert prefilled(fakes) == [want]
    assert r.json()["usage"]["prompt_tokens"] == len(want)


def test_an_empty_prompt_with_a_suffix_is_the_hole_at_the_start(fim_cluster, oracle):
    fakes, server = fim_cluster
    fakes.messages.clear()
    r = post(server, {"prompt": "", "suffix": SUFFIX, "max_tokens": 2})
    assert r.status_code == 200, r.text
    want = oracle("", SUFFIX)
    assert want[:3] == [0, 512, 513]
    assert prefilled(fakes) == [want]


@pytest.mark.parametrize("suffix", ["", None])
def test_an_empty_suffix_is_no_suffix(fim_cluster, fim_dir, suffix):
    fakes, server = fim_cluster
    fakes.messages.clear()
    r = post(server, {"prompt": PROMPT, "suffix": suffix, "max_tokens": 2, "echo": True})
    assert r.status_code == 200, r.text
    hf = HfTokenizer.from_file(str(fim_dir / "tokenizer.json"))
    want = hf.encode(PROMPT, add_special_tokens=True).ids  # the plain prompt, bos first
    assert prefilled(fakes) == [want]
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    assert r.json()["choices"][0]["text"].startswith(PROMPT)  # echo is fine without a suffix


# ---- refusals ---------------------------------------------------------------------------------
def test_a_model_without_fim_tokens_refuses_a_suffix(plain_cluster):
    error = assert_refused(
        plain_cluster, {"prompt": PROMPT, "suffix": SUFFIX}, "suffix", "unsupported"
    )
    assert error["message"] == (
        "suffix: this model has no fill-in-the-middle tokens "
        "(<｜fim▁begin｜>, <｜fim▁hole｜>, <｜fim▁end｜>)"
    )
    batch = {"prompt": ["a", "b"], "suffix": SUFFIX}
    assert assert_refused(plain_cluster, batch, "suffix", "unsupported") == error


def test_an_empty_suffix_is_served_by_a_model_without_fim(plain_cluster, tok):
    fakes, server = plain_cluster
    fakes.messages.clear()
    r = post(server, {"prompt": PROMPT, "suffix": "", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert prefilled(fakes) == [tok.encode_prompt(PROMPT)]


@pytest.mark.parametrize("cluster", ["fim_cluster", "plain_cluster"])
def test_echo_with_a_suffix_is_refused(request, cluster):
    body = {"prompt": PROMPT, "suffix": SUFFIX, "echo": True}
    assert_refused(request.getfixturevalue(cluster), body, "suffix", "invalid_value", "echo")


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6], [7]]])
@pytest.mark.parametrize("cluster", ["fim_cluster", "plain_cluster"])
def test_token_id_prompts_with_a_suffix_are_refused(request, cluster, prompt):
    body = {"prompt": prompt, "suffix": SUFFIX}
    cl = request.getfixturevalue(cluster)
    assert_refused(cl, body, "suffix", "invalid_value", "needs a text prompt", "token ids")


def test_fim_tokens_outside_the_model_vocab_are_refused(tmp_path, model_dir):
    """A copy of the built-in model with the tokens added: its tokenizer already fills the 2048
    ids of config.json's vocab_size, so the tokens get 2048-2050 and the prompt is refused."""
    d = tmp_path / "tiny-fim"
    shutil.copytree(model_dir, d)
    assert json.loads((d / "config.json").read_text())["vocab_size"] == 2048
    assert add_fim_tokens(d) == [2048, 2049, 2050]
    started = []
    try:
        cluster = _cluster(d, started)
        body = {"prompt": PROMPT, "suffix": SUFFIX}
        error = assert_refused(cluster, body, "prompt", "invalid_prompt")
        assert error["message"] == "token id 2048 is outside the vocabulary [0, 2048)"
    finally:
        stop_all(started)
