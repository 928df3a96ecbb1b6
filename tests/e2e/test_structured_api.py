"""End to end: structured output on a real `duet up` cluster (1P1D, float32) through the
official openai client, streamed and not, on both endpoints. Every output parses (json.loads)
and validates against its schema (jsonschema), or matches its regex / is one of its choices,
and equals `duet generate --structured` with the same params token for token (the first token
masked on the prefill node, the rest on the decode node). Bad specs are a 400. On the random
tiny model, which the cases are bounded for (`structured_cases`): it closes them within MAX_NEW
tokens, as the trained default model need not when sampling."""

import json

import openai
import pytest
from e2e_helpers import generate_reference, start_cluster
from structured_cases import CASES, JSON_OBJECT, MAX_NEW, check_output

from control.tokenizer import Tokenizer
from tinymodel.make import make_tiny_model

DTYPE = "float32"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Give me JSON."}]
ALL_CASES = {**CASES, "json_object": JSON_OBJECT}
SAMPLINGS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 1.5, "seed": 7}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("random") / "tiny-model", seed=0))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir):
    """conftest's fp32_cluster on the random tiny model."""
    args = ["--prefill", "1", "--decode", "1", "--dtype", DTYPE, "--threads", "1"]
    up = start_cluster([*args, "--model", model_dir], tmp_path_factory)
    yield up
    up.stop()


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


def api_fields(kind: str, spec: str, chat: bool) -> dict:
    """How a client asks for (kind, spec): OpenAI's response_format where it has the kind (a
    native parameter on chat), vLLM's guided_* otherwise."""
    if kind == "json_schema":
        schema = {"name": "case", "schema": json.loads(spec), "strict": True}
        fmt = {"type": "json_schema", "json_schema": schema}
    elif kind == "json_object":
        fmt = {"type": "json_object"}
    elif kind == "regex":
        return {"extra_body": {"guided_regex": spec}}
    else:
        return {"extra_body": {"guided_choice": json.loads(spec)}}
    return {"response_format": fmt} if chat else {"extra_body": {"response_format": fmt}}


def reference(tok, model_dir, kind: str, spec: str, sampling: dict, chat: bool) -> dict:
    flags = ["--structured", f"{kind}:{spec}"]
    if sampling["temperature"]:
        flags += ["--temperature", str(sampling["temperature"]), "--seed", str(sampling["seed"])]
    if chat:
        ids = tok.encode_chat(MESSAGES)
        return generate_reference(DTYPE, MAX_NEW, prompt_ids=ids, extra=flags, model=model_dir)
    return generate_reference(DTYPE, MAX_NEW, prompt=PROMPT, extra=flags, model=model_dir)


def run(client, chat: bool, stream: bool, **kwargs) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of one request."""
    kwargs = dict(model="tiny-model", max_tokens=MAX_NEW, **kwargs)
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    if chat:
        out = client.chat.completions.create(messages=MESSAGES, stream=stream, **usage, **kwargs)
    else:
        out = client.completions.create(prompt=PROMPT, stream=stream, **usage, **kwargs)
    if not stream:
        choice = out.choices[0]
        text = choice.message.content if chat else choice.text
        return text, choice.finish_reason, out.usage.completion_tokens
    chunks = list(out)
    pieces = [c.choices[0] for c in chunks if c.choices]
    text = "".join((p.delta.content or "") if chat else p.text for p in pieces)
    finish = next(p.finish_reason for p in reversed(pieces) if p.finish_reason)
    return text, finish, chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("name", ALL_CASES)
def test_outputs_validate_and_match_duet_generate(
    cluster, tok, model_dir, name, sampling, endpoint, stream
):
    kind, spec = ALL_CASES[name]
    chat = endpoint == "chat"
    ref = reference(tok, model_dir, kind, spec, SAMPLINGS[sampling], chat)
    fields = api_fields(kind, spec, chat)
    text, finish, num_tokens = run(cluster.client(), chat, stream, **SAMPLINGS[sampling], **fields)
    assert finish == "stop", text  # complete, not cut at max_tokens
    check_output(kind, spec, text)
    assert text == ref["text"] and num_tokens == len(ref["token_ids"])


def test_ignore_eos_does_not_run_past_the_grammar(cluster):
    text, finish, _ = run(
        cluster.client(),
        False,
        False,
        temperature=0.0,
        extra_body={"guided_choice": ["yes", "no"], "ignore_eos": True},
    )
    assert finish == "stop" and text in ("yes", "no")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"extra_body": {"guided_json": {"type": "object", "required": 3}}}, "invalid json_schema"),
        ({"extra_body": {"guided_regex": "(ab"}}, "invalid regex"),
        (
            {"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}},
            "at most one structured output field",
        ),
        (
            {
                "extra_body": {
                    "response_format": {"type": "json_object"},
                    "structured_outputs": {"regex": "a"},
                }
            },
            "at most one structured output field",
        ),
    ],
)
def test_bad_specs_are_a_400(cluster, kwargs, message):
    c = cluster.client()
    with pytest.raises(openai.BadRequestError, match=message):
        c.completions.create(model="tiny-model", prompt="x", max_tokens=4, **kwargs)
    bad_chat = {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}
    with pytest.raises(openai.BadRequestError, match="invalid json_schema"):
        c.chat.completions.create(
            model="tiny-model",
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": bad_chat},
        )


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_choices_each_validate_and_match_their_seed(cluster, tok, model_dir, endpoint):
    """n = 3: one prefill, the grammar forked with the KV; choice i is `duet generate` with
    seed + i, and each one validates."""
    kind, spec = CASES["object"]
    chat = endpoint == "chat"
    sampling = {"temperature": 1.5, "seed": 11}
    fields = api_fields(kind, spec, chat)
    kwargs = dict(model="tiny-model", max_tokens=MAX_NEW, n=3, **sampling, **fields)
    c = cluster.client()
    if chat:
        out = c.chat.completions.create(messages=MESSAGES, **kwargs)
        texts = {ch.index: ch.message.content for ch in out.choices}
    else:
        out = c.completions.create(prompt=PROMPT, **kwargs)
        texts = {ch.index: ch.text for ch in out.choices}
    assert sorted(texts) == [0, 1, 2] and all(ch.finish_reason == "stop" for ch in out.choices)
    for i, text in texts.items():
        check_output(kind, spec, text)
        ref = reference(tok, model_dir, kind, spec, {"temperature": 1.5, "seed": 11 + i}, chat)
        assert text == ref["text"], i
