"""End to end: `duet up --decode-quant int8` (and int4), a bf16 prefill node feeding an int8 (int4)
decode node, served to the official openai client. Greedy outputs equal `duet generate
--prefill-quant none --decode-quant int8` (its offline twin); /metrics and /v1/cluster say which scheme each node
runs. The KV wire format is the same whatever the schemes, so the pair needs nothing else."""

import httpx
import pytest
import torch
from e2e_helpers import generate_reference, start_cluster

from control.tokenizer import Tokenizer
from model.deepseek import DeepseekModel
from tinymodel.make import ensure_tiny_model

PROMPTS = ["The quick brown fox", "Once upon a time there was", "1, 2, 3, 4,"]
MAX_NEW = 16


@pytest.fixture(scope="module", params=["int8", "int4"])
def cluster(tmp_path_factory, request):
    args = ["--prefill", "1", "--decode", "1", "--threads", "1", "--decode-quant", request.param]
    up = start_cluster(args, tmp_path_factory)
    up.decode_quant = request.param
    yield up
    up.stop()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_bf16_prefill_quantized_decode_matches_generate(cluster, prompt):
    out = cluster.client().completions.create(
        model="tiny-model", prompt=prompt, max_tokens=MAX_NEW, temperature=0.0
    )
    want = generate_reference(
        "bfloat16",
        MAX_NEW,
        prompt=prompt,
        extra=("--prefill-quant", "none", "--decode-quant", cluster.decode_quant, "--threads", "1"),
    )
    assert out.choices[0].text == want["text"]
    assert out.usage.completion_tokens == len(want["token_ids"])


def _offline_logprobs(prefill_model, decode_model, prompt_ids, tokens) -> list[float]:
    """Each token's raw logprob: the first from `prefill_model`'s prefill, the rest from
    `decode_model`'s decode steps over that KV (as the PD pair computes them)."""
    from runtime.generate import OfflineGenerator

    gen = OfflineGenerator(prefill_model, decode_model=decode_model)
    table = gen.pool.new_table()
    try:
        logits = [gen.prefill(table, prompt_ids)]
        for i, token in enumerate(tokens[:-1]):
            logits.append(gen.decode(table, token, len(prompt_ids) + i))
    finally:
        gen.pool.release(table)
    rows = torch.stack(logits).float().log_softmax(-1)
    return rows[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def test_decode_logprobs_are_the_quantized_models(cluster):
    """The tiny model's greedy text is too repetitive to tell int8 from bf16 decoding, its
    logprobs are not: the pair's equal the offline bf16-prefill + int8-decode ones (int4), and differ
    from the all-bf16 ones past the first token (which the bf16 prefill node samples)."""
    model_dir = ensure_tiny_model()
    prompt = PROMPTS[1]
    out = cluster.client().completions.create(
        model="tiny-model", prompt=prompt, max_tokens=MAX_NEW, temperature=0.0, logprobs=1
    )
    mixed = ("--prefill-quant", "none", "--decode-quant", cluster.decode_quant, "--threads", "1")
    reference = generate_reference("bfloat16", MAX_NEW, prompt=prompt, extra=mixed)
    tokens = reference["token_ids"]  # the same greedy tokens (the test above)
    assert out.choices[0].text == reference["text"]
    got = out.choices[0].logprobs.token_logprobs
    assert len(got) == len(tokens)
    prompt_ids = Tokenizer(model_dir).encode_prompt(prompt)
    load = lambda q: DeepseekModel.from_pretrained(  # noqa: E731
        model_dir, torch.bfloat16, progress=False, quant=q
    )
    bf16, quantized = load(None), load(cluster.decode_quant)
    want = _offline_logprobs(bf16, quantized, prompt_ids, tokens)
    all_bf16 = _offline_logprobs(bf16, bf16, prompt_ids, tokens)
    assert got == pytest.approx(want, abs=1e-4)
    assert got[0] == pytest.approx(all_bf16[0], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(got[1:], all_bf16[1:], strict=True)) > 1e-3


def test_streamed_chat_from_the_mixed_pair(cluster):
    stream = cluster.client().chat.completions.create(
        model="tiny-model",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0.0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks)


def test_each_node_reports_its_scheme(cluster):
    # (labels in the exposition's order: sorted)
    quant = cluster.decode_quant
    assert cluster.metric("duet_node_quant_info", node="decode-0", quant=quant, role="decode") == 1
    assert (
        cluster.metric("duet_node_quant_info", node="prefill-0", quant="none", role="prefill") == 1
    )
    assert cluster.metric("duet_node_quant_info", node="decode-0", quant="none", role="decode") == 0
    nodes = httpx.get(cluster.url + "/v1/cluster", timeout=10).json()["nodes"]
    assert {n["name"]: n["quantization"] for n in nodes} == {
        "prefill-0": "bf16",
        "decode-0": quant,
    }
