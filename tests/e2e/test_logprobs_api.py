"""Logprobs from a float32 `duet up` cluster through the openai client, against the offline
model's teacher-forced fp32 log_softmax over prompt + output (raw logprobs), loaded here."""

import openai
import pytest
import torch
from oracles import teacher_forced

from model.deepseek import DeepseekModel
from tinymodel.make import ensure_tiny_model

ATOL = 1e-4  # fp32 on both sides; chunked prefill and the decode path sum in another order
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def cluster(fp32_cluster):
    return fp32_cluster


@pytest.fixture(scope="module")
def model():
    return DeepseekModel.from_pretrained(ensure_tiny_model(), torch.float32, progress=False)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_with_echo(cluster, tok, model, stream):
    out = cluster.client().completions.create(
        model="tiny-model",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.0,
        logprobs=3,
        echo=True,
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    chunks = list(out) if stream else [out]
    token_lps, tops = [], []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                token_lps += choice.logprobs.token_logprobs
                tops += choice.logprobs.top_logprobs
    prompt_ids = tok.encode_prompt(PROMPT)
    assert token_lps[0] is None and len(token_lps) == len(prompt_ids) + 6
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.startswith(PROMPT)
    # The output ids: greedy picks the top of each position's distribution.
    ids = list(prompt_ids)
    for _ in range(6):
        ids.append(int(teacher_forced(model, ids)[-1].argmax()))
    ref = teacher_forced(model, ids)
    for p in range(1, len(ids)):
        assert token_lps[p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=ATOL)
        # {token text: logprob}: two ids of one text (byte pieces of a character) share a key
        top = ref[p - 1].topk(3)
        want = {}
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            want.setdefault(tok.decode([t], skip_special_tokens=False), v)
        want.setdefault(tok.decode([ids[p]], skip_special_tokens=False), ref[p - 1, ids[p]].item())
        assert tops[p].keys() == want.keys()
        assert list(tops[p].values()) == pytest.approx(list(want.values()), abs=ATOL)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt(cluster, tok, model, stream):
    """lm-evaluation-harness's loglikelihood request: the prompt's text and logprobs only, no
    completion token (usage 0), finish_reason "length"."""
    text = "The quick brown fox jumps over the lazy dog"
    out = cluster.client().completions.create(
        model="tiny-model",
        prompt=[text, PROMPT],
        max_tokens=0,
        logprobs=1,
        echo=True,
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
    )
    chunks = list(out) if stream else [out]
    texts, lps, finishes = {}, {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.logprobs is not None:
                lps[choice.index] = lps.get(choice.index, []) + choice.logprobs.token_logprobs
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert texts == {0: text, 1: PROMPT} and finishes == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 0
    for i, prompt in enumerate([text, PROMPT]):
        ids = tok.encode_prompt(prompt)
        ref = teacher_forced(model, ids)
        assert lps[i][0] is None and len(lps[i]) == len(ids)
        want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
        assert lps[i][1:] == pytest.approx(want, abs=ATOL)


def test_max_tokens_0_without_echo_is_a_400(cluster):
    with pytest.raises(openai.BadRequestError, match="max_tokens must be in"):
        cluster.client().completions.create(model="tiny-model", prompt="x", max_tokens=0)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(cluster, tok, model, stream):
    messages = [{"role": "user", "content": "Hi"}]
    out = cluster.client().chat.completions.create(
        model="tiny-model",
        messages=messages,
        max_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    if stream:
        content = [
            e
            for c in out
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ]
    else:
        content = out.choices[0].logprobs.content
    assert len(content) == 5
    ids = tok.encode_chat(messages)
    prompt_len = len(ids)
    for _ in range(5):
        ids.append(int(teacher_forced(model, ids)[-1].argmax()))
    ref = teacher_forced(model, ids)
    for i, entry in enumerate(content):
        pos = prompt_len + i - 1
        assert entry.logprob == pytest.approx(ref[pos, ids[pos + 1]].item(), abs=ATOL)
        assert entry.token == tok.decode([ids[pos + 1]], skip_special_tokens=False)
        top = [t.logprob for t in entry.top_logprobs]
        assert top == pytest.approx(ref[pos].topk(2).values.tolist(), abs=ATOL)


def test_too_many_logprobs_is_a_400(cluster):
    import openai

    with pytest.raises(openai.BadRequestError, match=r"logprobs must be in \[0, 20\]"):
        cluster.client().completions.create(model="tiny-model", prompt="x", logprobs=21)
