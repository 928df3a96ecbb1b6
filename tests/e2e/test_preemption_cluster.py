"""End to end, on-demand decode KV with preemption: `duet up` (1P1D, float32,
one decode rank and two) with a decode pool of 4 pages of 16 tokens per rank and the real router.

Each request (a 5-6 token prompt, 48 tokens with ignore_eos) reserves one page up front (prompt +
8 tokens of headroom) and needs all 4 to finish, so whenever two of them share a pool one must be
preempted. No timing luck: the prefill node is frozen (SIGSTOP) until the router has dispatched
all three, so all three hold their page on the decode node together (with two ranks, two of
them share a rank). The router re-prefills each preempted request; every client gets exactly
`duet generate`'s text, greedy and seeded sampling alike (a re-prefilled attempt draws on
after the tokens already streamed: `SamplingParams.draw_offset`), the router and the node
counted preemptions, and the decode pages return to zero."""

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2e_helpers import cluster_shorthand, generate_reference, start_cluster, wait_until

from deploy.local_cluster import dump_toml

PROMPTS = ["Hello world", "Once upon a time", "A B C"]
MAX_NEW = 48
# Greedy, and two seeded streams hot enough to wander (which of the three are preempted
# depends on their arrival order).
SAMPLING = {
    "Hello world": {"temperature": 0},
    "Once upon a time": {"temperature": 1.5, "seed": 101},
    "A B C": {"temperature": 1.5, "seed": 102},
}


def _reference_args(prompt: str) -> tuple[str, ...]:
    sampling = SAMPLING[prompt]
    if not sampling["temperature"]:
        return ("--ignore-eos",)
    return ("--ignore-eos", "--temperature", str(sampling["temperature"]),
            "--seed", str(sampling["seed"]))  # fmt: skip


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def cluster(request, tmp_path_factory):
    raw = cluster_shorthand(1, 1)
    raw["decode"][0].update(
        num_pages=4,
        page_size=16,
        kv_reservation="on_demand",
        kv_headroom_tokens=8,
        max_batch=4,
        ranks=request.param,
    )
    raw["router"]["max_preemptions"] = 100  # thrashing on a pool this small is expected
    # The prefill node is frozen for a moment: far inside these.
    raw["timeouts"] = {"node_timeout_s": 60.0, "lease_s": 60.0}
    config = tmp_path_factory.mktemp("cfg") / "preempt.toml"
    config.write_text(dump_toml(raw))
    up = start_cluster(["--config", str(config), "--dtype", "float32"], tmp_path_factory)
    yield up
    up.stop()


def _complete(cluster, prompt: str) -> dict:
    body = {"model": "tiny-model", "prompt": prompt, "max_tokens": MAX_NEW, "ignore_eos": True,
            **SAMPLING[prompt]}  # fmt: skip
    r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_pool_too_small_for_all_preempts_and_every_output_is_exact(cluster):
    want = {
        p: generate_reference("float32", MAX_NEW, prompt=p, extra=_reference_args(p))["text"]
        for p in PROMPTS
    }
    used = lambda: cluster.metric("duet_kv_pages_used", node="decode-0", role="decode")  # noqa: E731
    assert wait_until(lambda: used() == 0, 30)
    dispatched = lambda: cluster.metric(  # noqa: E731
        "duet_node_requests_total", node="prefill-0", role="prefill"
    )
    before = dispatched()
    prefill_pid = cluster.child_pids["prefill-0"]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        os.kill(prefill_pid, signal.SIGSTOP)
        try:
            futures = {p: pool.submit(_complete, cluster, p) for p in PROMPTS}
            # Prefill is sent only once the decode node reserved: all three hold their page.
            assert wait_until(lambda: dispatched() == before + len(PROMPTS), 60)
        finally:
            os.kill(prefill_pid, signal.SIGCONT)
        got = {p: f.result(timeout=300) for p, f in futures.items()}
    for prompt in PROMPTS:
        choice = got[prompt]["choices"][0]
        assert choice["text"] == want[prompt], prompt
        assert got[prompt]["usage"]["completion_tokens"] == MAX_NEW
    assert cluster.metric("duet_router_preemptions_total") > 0
    assert cluster.metric("duet_requests_total", outcome="failed") == 0
    preempted = lambda: cluster.metric(  # noqa: E731
        "duet_node_preemptions_total", node="decode-0", role="decode"
    )
    assert wait_until(lambda: preempted() == cluster.metric("duet_router_preemptions_total"), 30)
    assert wait_until(lambda: used() == 0, 30), "decode pages did not return to zero"
