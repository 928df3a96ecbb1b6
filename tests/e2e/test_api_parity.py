"""End to end: the API parity surface on a real `duet up` cluster (1P1D, float32) with the
official openai client: a batch of prompts in one request, and vLLM's /tokenize and /detokenize.

The oracle for outputs is `duet generate --json` with the same dtype: in float32 greedy outputs
do not depend on what a request is batched with, so each prompt of the batch must give, token
for token, what it gives alone offline."""

import httpx
import pytest
from e2e_helpers import generate_reference, wait_until

PROMPTS = ["Hello world", "The quick brown fox", "日本語のテキスト 🚀"]
MAX_NEW = 12
DTYPE = "float32"


@pytest.fixture(scope="module")
def cluster(fp32_cluster):
    return fp32_cluster


@pytest.fixture(scope="module")
def refs():
    return [generate_reference(DTYPE, MAX_NEW, prompt=p) for p in PROMPTS]


def test_batch_of_prompts_matches_duet_generate(cluster, refs, tok):
    c = cluster.client()
    kwargs = dict(model="tiny-model", prompt=PROMPTS, max_tokens=MAX_NEW, temperature=0)
    out = c.completions.create(**kwargs)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert [ch.text for ch in out.choices] == [r["text"] for r in refs]
    assert out.usage.completion_tokens == sum(len(r["token_ids"]) for r in refs)
    assert out.usage.prompt_tokens == sum(len(tok.encode_prompt(p)) for p in PROMPTS)

    stream = c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    texts, usage = ["", "", ""], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [r["text"] for r in refs]
    assert usage.completion_tokens == out.usage.completion_tokens
    pages = lambda: cluster.metric("duet_kv_pages_used", node="decode-0", role="decode")  # noqa: E731
    assert wait_until(lambda: pages() == 0, 10)  # every prompt's pages came back


def test_tokenize_detokenize_over_http(cluster, tok):
    url = cluster.url
    for text in PROMPTS:
        out = httpx.post(url + "/tokenize", json={"model": "tiny-model", "prompt": text}).json()
        assert out["tokens"] == tok.encode_prompt(text) and out["count"] == len(out["tokens"])
        assert out["max_model_len"] == 512
        back = httpx.post(url + "/detokenize", json={"tokens": out["tokens"]}).json()
        assert back["prompt"] == tok.decode(out["tokens"], skip_special_tokens=False)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    out = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    assert out["tokens"] == tok.encode_chat(messages)
    assert cluster.client().models.retrieve("tiny-model").id == "tiny-model"
