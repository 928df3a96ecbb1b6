"""End to end: `duet up --mtp-tokens 2` on a checkpoint with an MTP layer, served to the
official openai client, with one decode rank and with two (expert-parallel: the MTP layer's
experts are split like the others'), and with a prefill node of two tensor-parallel ranks (the
MTP layer split like the others, over every rank's own hidden states). The prefill node runs the MTP layer behind the prompt and
sends its KV (one more layer) and its first draft; the decode node speculates. Greedy outputs
equal plain `duet generate` (no MTP, the oracle), alone and concurrent (spread over both
ranks when there are two), and seeded sampled ones `duet generate --mtp-tokens 2` (its offline twin); /metrics
exports the acceptance figures."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2e_helpers import generate_reference, start_cluster, wait_until

from tinymodel.make import make_tiny_model

PROMPTS = ["The quick brown fox", "Once upon a time there was", "1, 2, 3, 4,"]
MAX_NEW = 16


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return str(
        make_tiny_model(  # served under its folder's name
            tmp_path_factory.mktemp("mtp") / "mtp-model",
            seed=5,
            overrides={"num_nextn_predict_layers": 1},
        )
    )


@pytest.fixture(
    scope="module", params=[(1, 1), (1, 2), (2, 1)], ids=["1rank", "2ranks", "2prefill-ranks"]
)
def cluster(request, tmp_path_factory, mtp_dir):
    prefill_ranks, decode_ranks = request.param
    args = ["--model", mtp_dir, "--threads", "1", "--mtp-tokens", "2", "--dtype", "float32",
            "--decode-ranks", str(decode_ranks), "--prefill-ranks", str(prefill_ranks)]  # fmt: skip
    up = start_cluster(args, tmp_path_factory)
    yield up
    up.stop()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_with_mtp_equals_plain_generate(cluster, mtp_dir, prompt):
    out = cluster.client().completions.create(
        model="mtp-model", prompt=prompt, max_tokens=MAX_NEW, temperature=0.0
    )
    want = generate_reference("float32", MAX_NEW, prompt=prompt, extra=("--model", mtp_dir))
    assert out.choices[0].text == want["text"]
    assert out.usage.completion_tokens == len(want["token_ids"])


def test_concurrent_greedy_streams_with_mtp_equal_plain_generate(cluster, mtp_dir):
    def complete(prompt):
        out = cluster.client().completions.create(
            model="mtp-model", prompt=prompt, max_tokens=MAX_NEW, temperature=0.0
        )
        return out.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(complete, PROMPTS))
    for prompt, text in zip(PROMPTS, texts, strict=True):
        want = generate_reference("float32", MAX_NEW, prompt=prompt, extra=("--model", mtp_dir))
        assert text == want["text"], prompt


def test_seeded_sampling_with_mtp_equals_its_offline_twin(cluster, mtp_dir):
    prompt = PROMPTS[1]
    out = cluster.client().completions.create(
        model="mtp-model", prompt=prompt, max_tokens=MAX_NEW, temperature=1.2, seed=7
    )
    extra = ("--model", mtp_dir, "--mtp-tokens", "2", "--temperature", "1.2", "--seed", "7")
    want = generate_reference("float32", MAX_NEW, prompt=prompt, extra=extra)
    assert out.choices[0].text == want["text"]


def test_metrics_export_the_acceptance_figures(cluster):
    cluster.client().completions.create(
        model="mtp-model", prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0.0
    )
    labels = {"node": "decode-0", "role": "decode"}
    assert wait_until(lambda: cluster.metric("duet_mtp_draft_tokens_total", **labels) > 0, 30)
    # One scrape for all four: the next heartbeat may move the counters between two scrapes.
    page = httpx.get(cluster.url + "/metrics", timeout=10).text
    value = {}
    for line in page.splitlines():
        if not line.startswith("#"):
            sample, _, number = line.rpartition(" ")
            value[sample] = float(number)
    key = '{node="decode-0",role="decode"}'
    drafted = value["duet_mtp_draft_tokens_total" + key]
    accepted = value["duet_mtp_accepted_tokens_total" + key]
    assert drafted > 0 and value["duet_mtp_acceptance_ratio" + key] == pytest.approx(
        accepted / drafted
    )
    assert value["duet_mtp_tokens_per_step" + key] >= 1.0
