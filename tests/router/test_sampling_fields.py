"""The sampling fields over fake nodes: the official openai client sends every one (vLLM's
extensions through extra_body), streamed and not, and the nodes receive exactly the
SamplingParams it asked for (the prompt's ids too, when the repetition penalty needs them);
values out of range are a 400 naming the field, before anything reaches a node."""

import httpx
import openai
import pytest
from router_fakes import RecordingCluster, RouterServer, assert_invalid_value, fake_config

from control.protocol import Prefill, Reserve, sampling_from_dict
from control.sampling_params import SamplingParams
from control.tokenizer import Tokenizer
from tinymodel.make import make_tiny_model

VOCAB = 512  # the random tiny model's (`model_dir`)
SCRIPT = "one two three four five six seven eight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The random tiny model: the vocabulary bounds asserted below are its 512 tokens (the
    default, trained model has 2048)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("random") / "tiny-model", seed=0))


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def cluster(tok, model_dir):
    cfg = fake_config()
    fakes = RecordingCluster(cfg, tok.encode(SCRIPT), eos_id=tok.eos_token_ids[0])
    fakes.start()
    server = RouterServer(cfg, model_dir)
    server.start()
    yield fakes, server
    server.stop()
    fakes.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=20)


WANT = SamplingParams(
    temperature=0.7,
    top_p=0.9,
    top_k=20,
    seed=42,
    max_new_tokens=6,
    stop_token_ids=(9, 10),
    ignore_eos=True,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.3,
    min_p=0.05,
    min_tokens=2,
    logit_bias=((5, 2.5), (17, -100.0)),
)
EXTRA = {
    "top_k": 20,
    "ignore_eos": True,
    "stop_token_ids": [9, 10],
    "repetition_penalty": 1.3,
    "min_p": 0.05,
    "min_tokens": 2,
}
OPENAI = dict(
    temperature=0.7,
    top_p=0.9,
    seed=42,
    max_tokens=6,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    logit_bias={"5": 2.5, "17": -100},
)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_sampling_field_reaches_the_nodes(cluster, tok, stream, endpoint):
    fakes, server = cluster
    fakes.messages.clear()
    c = client(server)
    if endpoint == "completions":
        out = c.completions.create(
            model="tiny-model", prompt="Hello", stream=stream, extra_body=EXTRA, **OPENAI
        )
        prompt = tok.encode_prompt("Hello")
    else:
        messages = [{"role": "user", "content": "Hello"}]
        out = c.chat.completions.create(
            model="tiny-model", messages=messages, stream=stream, extra_body=EXTRA, **OPENAI
        )
        prompt = tok.encode_chat(messages)
    if stream:
        list(out)
    (reserve,) = fakes.sent(Reserve)
    (prefill,) = fakes.sent(Prefill)
    assert sampling_from_dict(reserve.sampling) == WANT == sampling_from_dict(prefill.sampling)
    assert reserve.prompt_ids == prompt == prefill.token_ids  # the repetition penalty reads it


def test_the_prompt_goes_to_the_decode_node_only_for_the_repetition_penalty(cluster):
    fakes, server = cluster
    fakes.messages.clear()
    c = client(server)
    c.completions.create(model="tiny-model", prompt="Hi", max_tokens=2, presence_penalty=1.0)
    (reserve,) = fakes.sent(Reserve)
    assert reserve.prompt_ids == [] and sampling_from_dict(reserve.sampling).presence_penalty == 1
    # defaults and JSON nulls mean "off"
    fakes.messages.clear()
    extra = {"repetition_penalty": None, "min_p": None}
    c.completions.create(model="tiny-model", prompt="Hi", max_tokens=2, extra_body=extra)
    (reserve,) = fakes.sent(Reserve)
    got = sampling_from_dict(reserve.sampling)
    assert got == SamplingParams(max_new_tokens=2) and reserve.prompt_ids == []


@pytest.mark.parametrize(
    "fields,param,message",
    [
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be > 0"),
        ({"repetition_penalty": -1.5}, "repetition_penalty", "repetition_penalty must be > 0"),
        ({"min_p": 1.5}, "min_p", "min_p must be in [0, 1]"),
        ({"min_p": -0.1}, "min_p", "min_p must be in [0, 1]"),
        ({"min_tokens": -1}, "min_tokens", "min_tokens must be in [0,"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "min_tokens must be at most max_tokens"),
        ({"logit_bias": {"512": 1}}, "logit_bias", "token id 512 is outside the vocabulary"),
        ({"logit_bias": {"9" * 40: 1}}, "logit_bias", "is outside the vocabulary [0, 512)"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "'abc' is not a token id"),
        ({"logit_bias": {"-5": 1}}, "logit_bias", "'-5' is not a token id"),
        ({"logit_bias": {"5": 150}}, "logit_bias", "the bias of token 5 must be in [-100, 100]"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias", "must be in [-100, 100], got -100.5"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_values_out_of_range_are_a_400_naming_the_field(cluster, fields, param, message, path):
    assert_invalid_value(cluster, path, fields, param, message)


@pytest.mark.parametrize(
    "fields", [{"logit_bias": {"5": "high"}}, {"min_tokens": 1.5}, {"repetition_penalty": "1"}]
)
def test_wrong_types_are_a_422(cluster, fields):
    _, server = cluster
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", **fields}, timeout=10)
    assert r.status_code == 422 and r.json()["error"]["param"].startswith(next(iter(fields)))


def test_the_openai_client_sees_the_400(cluster):
    _, server = cluster
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client(server).completions.create(
            model="tiny-model", prompt="x", logit_bias={str(VOCAB + 3): 1}
        )
