"""End to end: every sampling parameter on a real `duet up` cluster (1P1D, float32) through the
official openai client (vLLM's extensions in extra_body), streamed and not.

The oracle is `duet generate --json` with the same flags: the first token is sampled on the
prefill node (its past: the prompt only), the rest on the decode node (output token counts kept
per batch slot), and a seed's stream continues across the two, so the text must be the same
token for token, greedy or seeded."""

import json

import openai
import pytest
from e2e_helpers import generate_reference

DTYPE = "float32"
MAX_NEW = 16
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def cluster(fp32_cluster):
    return fp32_cluster


@pytest.fixture(scope="module")
def greedy_first():
    """The first token greedy decoding picks (the target of the bias and min_tokens cases)."""
    return generate_reference(DTYPE, MAX_NEW, prompt=PROMPT)["token_ids"][0]


def cases(first: int) -> dict[str, tuple[dict, list[str]]]:
    """name -> (openai kwargs, the same as `duet generate` flags)."""
    bias = {str(first): -100, "7": 5}
    return {
        "penalties_greedy": (
            dict(
                temperature=0,
                presence_penalty=0.8,
                frequency_penalty=0.6,
                extra_body={"repetition_penalty": 1.5},
            ),
            "--presence-penalty 0.8 --frequency-penalty 0.6 --repetition-penalty 1.5".split(),
        ),
        "penalties_min_p_seeded": (
            dict(
                temperature=0.9,
                seed=7,
                frequency_penalty=0.3,
                extra_body={"top_k": 40, "min_p": 0.1, "repetition_penalty": 1.2},
            ),
            "--temperature 0.9 --seed 7 --frequency-penalty 0.3 --top-k 40 --min-p 0.1 "
            "--repetition-penalty 1.2".split(),
        ),
        "min_tokens_holds_the_stop_token": (
            dict(temperature=0, extra_body={"stop_token_ids": [first], "min_tokens": 5}),
            f"--stop-token-ids {first} --min-tokens 5".split(),
        ),
        "logit_bias_seeded": (
            dict(temperature=1.0, seed=3, logit_bias=bias),
            ["--temperature", "1.0", "--seed", "3", "--logit-bias", json.dumps(bias)],
        ),
        "ignore_eos_with_negative_penalties": (
            dict(
                temperature=0.7,
                seed=11,
                presence_penalty=-1.0,
                top_p=0.9,
                extra_body={"ignore_eos": True, "min_p": 0.05},
            ),
            "--temperature 0.7 --seed 11 --presence-penalty -1.0 --top-p 0.9 --ignore-eos "
            "--min-p 0.05".split(),
        ),
    }


CASES = list(cases(0))


def completion_text(client, stream: bool, **kwargs) -> tuple[str, int]:
    """(text, completion tokens) of one /v1/completions request."""
    kwargs = dict(model="tiny-model", prompt=PROMPT, max_tokens=MAX_NEW, **kwargs)
    if not stream:
        out = client.completions.create(**kwargs)
        return out.choices[0].text, out.usage.completion_tokens
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", CASES)
def test_completions_match_duet_generate(cluster, greedy_first, name, stream):
    kwargs, flags = cases(greedy_first)[name]
    ref = generate_reference(DTYPE, MAX_NEW, prompt=PROMPT, extra=flags)
    text, num_tokens = completion_text(cluster.client(), stream, **kwargs)
    assert text == ref["text"] and num_tokens == len(ref["token_ids"])
    if name == "min_tokens_holds_the_stop_token":
        assert len(ref["token_ids"]) >= 6 and greedy_first not in ref["token_ids"][:5]
    if name == "logit_bias_seeded":
        assert greedy_first not in ref["token_ids"]


def test_the_penalties_change_the_output(greedy_first):
    """Else matching the oracle would prove little."""
    plain = generate_reference(DTYPE, MAX_NEW, prompt=PROMPT)["token_ids"]
    for name in ("penalties_greedy", "min_tokens_holds_the_stop_token"):
        flags = cases(greedy_first)[name][1]
        assert generate_reference(DTYPE, MAX_NEW, prompt=PROMPT, extra=flags)["token_ids"] != plain


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_penalties_matches_duet_generate(cluster, tok, stream):
    messages = [{"role": "user", "content": "Count to five."}]
    flags = "--temperature 0.8 --seed 5 --repetition-penalty 1.3 --presence-penalty 0.5 "
    flags = (flags + "--min-p 0.05 --min-tokens 3").split()
    ref = generate_reference(DTYPE, MAX_NEW, prompt_ids=tok.encode_chat(messages), extra=flags)
    extra = {"repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 3}
    kwargs = dict(
        model="tiny-model",
        messages=messages,
        max_tokens=MAX_NEW,
        temperature=0.8,
        seed=5,
        presence_penalty=0.5,
        extra_body=extra,
    )
    c = cluster.client()
    if stream:
        text = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in c.chat.completions.create(**kwargs, stream=True)
            if chunk.choices
        )
    else:
        text = c.chat.completions.create(**kwargs).choices[0].message.content
    assert text == ref["text"]


def test_bad_sampling_is_a_400(cluster):
    c = cluster.client()
    with pytest.raises(openai.BadRequestError, match="presence_penalty must be in"):
        c.completions.create(model="tiny-model", prompt="x", presence_penalty=3)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        c.completions.create(model="tiny-model", prompt="x", logit_bias={"100000": 1})
