"""End to end: `n` > 1 and `best_of` on a real `duet up` cluster (1P1D, float32) through the
official openai client, streamed and not. One prefill per prompt; the decode node forks its KV.

Oracles: `duet generate --json`, where sequence i of a seeded request is the single request
with seed + i (greedy: every sequence is the greedy one); for best_of, the teacher-forced fp32
log-softmax of the tiny model (tests/oracles.py) ranks the generated sequences."""

import openai
import pytest
import torch
from e2e_helpers import generate_reference, wait_until
from oracles import teacher_forced

from model.deepseek import DeepseekModel
from tinymodel.make import ensure_tiny_model

DTYPE = "float32"
MAX_NEW = 12
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def cluster(fp32_cluster):
    return fp32_cluster


def reference(seed: int | None, prompt=PROMPT, prompt_ids=None, temperature=1.0) -> dict:
    extra = () if seed is None else ("--temperature", str(temperature), "--seed", str(seed))
    return generate_reference(DTYPE, MAX_NEW, prompt=prompt, prompt_ids=prompt_ids, extra=extra)


def pages_back(cluster) -> bool:
    used = lambda: cluster.metric("duet_kv_pages_used", node="decode-0", role="decode")  # noqa: E731
    return wait_until(lambda: used() == 0, 10.0)


def completions(cluster, stream: bool, **kwargs) -> tuple[list[str], int]:
    """(text of each choice, by index; completion tokens)."""
    kwargs = dict(model="tiny-model", max_tokens=MAX_NEW, **kwargs)
    c = cluster.client()
    if not stream:
        out = c.completions.create(**kwargs)
        assert [ch.index for ch in out.choices] == list(range(len(out.choices)))
        return [ch.text for ch in out.choices], out.usage.completion_tokens
    chunks = list(
        c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    texts: dict[int, str] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    return [texts[i] for i in sorted(texts)], chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_n3_gives_three_identical_choices(cluster, stream):
    ref = reference(None)
    texts, num_tokens = completions(cluster, stream, prompt=PROMPT, n=3, temperature=0)
    assert texts == [ref["text"]] * 3
    assert num_tokens == 3 * len(ref["token_ids"])  # usage counts every sequence
    assert pages_back(cluster)


@pytest.mark.parametrize("stream", [False, True])
def test_seeded_choices_are_their_seeds_continuations(cluster, stream):
    refs = [reference(7 + i) for i in range(3)]
    texts, num_tokens = completions(cluster, stream, prompt=PROMPT, n=3, temperature=1.0, seed=7)
    assert texts == [r["text"] for r in refs]
    assert len(set(texts)) > 1
    assert num_tokens == sum(len(r["token_ids"]) for r in refs)
    assert pages_back(cluster)


def test_a_batch_of_prompts_with_n2_numbers_choices_prompt_major(cluster):
    prompts = ["Once upon a time", "The quick brown fox"]
    texts, _ = completions(cluster, False, prompt=prompts, n=2, temperature=1.0, seed=3)
    expected = [reference(3 + j, prompt=p)["text"] for p in prompts for j in range(2)]
    assert texts == expected


@pytest.mark.parametrize("stream", [False, True])
def test_chat_n2(cluster, tok, stream):
    messages = [{"role": "user", "content": "Count to five."}]
    ids = tok.encode_chat(messages)
    refs = [reference(5 + i, prompt=None, prompt_ids=ids)["text"] for i in range(2)]
    kwargs = dict(
        model="tiny-model", messages=messages, max_tokens=MAX_NEW, n=2, temperature=1.0, seed=5
    )
    c = cluster.client()
    if stream:
        texts = {0: "", 1: ""}
        for chunk in c.chat.completions.create(**kwargs, stream=True):
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
        got = [texts[0], texts[1]]
    else:
        out = c.chat.completions.create(**kwargs)
        assert [ch.index for ch in out.choices] == [0, 1]
        got = [ch.message.content for ch in out.choices]
    assert got == refs


def test_best_of_returns_the_likeliest_sequences(cluster, tok):
    """best_of 4, n 2: the two generated sequences (seeds 11 .. 14) with the highest
    cumulative logprob under the model, likeliest first. (At temperature 2 the tiny model's
    four sequences differ; at 1 most are its one peaked continuation.)"""
    model = DeepseekModel.from_pretrained(ensure_tiny_model(), dtype=torch.float32, progress=False)
    prompt_ids = tok.encode_prompt(PROMPT)
    refs = [reference(11 + i, temperature=2.0) for i in range(4)]
    scores = []
    for ref in refs:
        out = ref["token_ids"]
        logprobs = teacher_forced(model, prompt_ids + out)[len(prompt_ids) - 1 :]
        scores.append(float(logprobs[torch.arange(len(out)), torch.tensor(out)].sum()))
    order = sorted(range(4), key=lambda i: -scores[i])
    assert scores[order[1]] - scores[order[2]] > 1e-3  # the cut is not a near tie
    texts, num_tokens = completions(
        cluster, False, prompt=PROMPT, n=2, best_of=4, temperature=2.0, seed=11
    )
    assert texts == [refs[order[0]]["text"], refs[order[1]]["text"]]
    assert num_tokens == sum(len(r["token_ids"]) for r in refs)
    out = cluster.client().completions.create(
        model="tiny-model",
        prompt=PROMPT,
        max_tokens=MAX_NEW,
        n=1,
        best_of=4,
        temperature=2.0,
        seed=11,
    )
    assert out.choices[0].text == refs[order[0]]["text"]
    assert out.choices[0].logprobs is None  # asked for none: the ranking's are not shown
    assert pages_back(cluster)


def test_bad_n_and_best_of_are_400s(cluster):
    c = cluster.client()
    with pytest.raises(openai.BadRequestError, match="n must be in"):
        c.completions.create(model="tiny-model", prompt="x", n=17)
    with pytest.raises(openai.BadRequestError, match="best_of must be in"):
        c.completions.create(model="tiny-model", prompt="x", n=3, best_of=2)
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        c.completions.create(model="tiny-model", prompt="x", best_of=2, stream=True)
