"""End to end: a prefill node of two tensor-parallel ranks (`ranks = 2`, `parallel = "tp"` and
"tp_sp", the shared-memory collectives) in a real `duet up` (float32).

Prompts share a six-page prefix and are prefilled in one-page chunks: cold, every output equals
`duet generate`'s (one process, the whole model); sent again, the prefix comes from rank 0's
cache (every rank holds the same KV rows at the same slots) and the outputs are the same. Ctrl-C
stops both ranks. A rank SIGKILLed while the node is inside a forward: the node reports failure,
the launcher restarts it, and every stream goes on to `duet generate`'s text; no rank is left."""

import os
import re
import signal

import pytest
from e2e_helpers import (
    alive,
    cluster_shorthand,
    generate_reference,
    processes_mentioning,
    start_cluster,
)
from e2e_helpers import wait_until as _wait
from test_decode_ranks import _cmdline, _streams

from deploy.local_cluster import dump_toml

SYSTEM = [(7 * i + 3) % 290 + 5 for i in range(96)]  # six pages of 16
PROMPTS = [SYSTEM + [11, 12, 13, 14, 15], SYSTEM + [200, 201], SYSTEM + [42, 43, 44]]
MAX_NEW = 8


def _config(tmp_path_factory, parallel="tp", **timeouts) -> str:
    raw = cluster_shorthand(1, 1)
    raw["dtype"] = "float32"
    raw["prefill"][0].update(ranks=2, chunk_size=16, parallel=parallel)
    if timeouts:
        raw["timeouts"] = timeouts
    path = tmp_path_factory.mktemp("cfg") / "prefill-ranks.toml"
    path.write_text(dump_toml(raw))
    return str(path)


@pytest.fixture(scope="module", params=["tp", "tp_sp"])
def cluster(request, tmp_path_factory):
    up = start_cluster(["--config", _config(tmp_path_factory, request.param)], tmp_path_factory)
    yield up
    up.stop()


def _rank_pids(up) -> list[int]:
    config = re.search(r"config (\S+\.toml)", up.log()).group(1)
    return [pid for pid in processes_mentioning(config) if "prefill_node.ranks" in _cmdline(pid)]


def _complete(up, prompt_ids):
    out = up.client().completions.create(
        model="tiny-model",
        prompt=prompt_ids,
        max_tokens=MAX_NEW,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


def _reference(prompt_ids):
    extra = ("--ignore-eos", "--chunk-size", "16")
    return generate_reference("float32", MAX_NEW, prompt_ids=prompt_ids, extra=extra)["text"]


def _prefix_hits(up) -> float:
    return up.metric("duet_prefix_cache_hits_total", node="prefill-0", role="prefill")


def test_outputs_equal_duet_generate_cold_and_from_the_cache(cluster):
    refs = [_reference(p) for p in PROMPTS]
    lookups = lambda: cluster.metric(  # noqa: E731
        "duet_prefix_cache_lookups_total", node="prefill-0", role="prefill"
    )
    first = [_complete(cluster, p) for p in PROMPTS]
    assert first == refs
    assert _wait(lambda: lookups() == len(PROMPTS), 30)  # a heartbeat after the first pass
    hits = _prefix_hits(cluster)
    second = [_complete(cluster, p) for p in PROMPTS]
    assert second == refs
    assert _wait(lambda: lookups() == 2 * len(PROMPTS), 30)
    assert _prefix_hits(cluster) == hits + len(PROMPTS)  # every second prompt hit the cache


def test_ctrl_c_stops_every_rank(cluster):
    ranks = _rank_pids(cluster)
    assert len(ranks) == 1 and alive(ranks[0])
    assert cluster.interrupt() == 0
    assert not alive(ranks[0])
    forwards = re.search(r"prefill-0\[1\] INFO rank 1: (\d+) forwards", cluster.log())
    assert forwards and int(forwards.group(1)) > 0  # rank 1 ran the forwards beside rank 0


def test_killing_a_rank_mid_prefill_restarts_the_node_and_its_requests_move(tmp_path_factory):
    """Rank 1 is frozen, so rank 0 waits for it in its first forward; once the router has sent
    the node every request, rank 1 is SIGKILLed: rank 0's wait fails, the node fails
    (NodeFailed), the launcher restarts it (both ranks), and every stream ends with
    `duet generate`'s text."""
    config = _config(tmp_path_factory, heartbeat_s=0.25, node_timeout_s=5.0, reserve_s=90.0)
    up = start_cluster(["--config", config], tmp_path_factory)
    refs = [_reference(p) for p in PROMPTS]
    try:
        (rank1,) = _rank_pids(up)
        os.kill(rank1, signal.SIGSTOP)
        try:
            thread, results = _streams(up, PROMPTS, MAX_NEW)
            dispatched = lambda: up.metric(  # noqa: E731
                "duet_node_requests_total", node="prefill-0", role="prefill"
            )
            assert _wait(lambda: dispatched() == len(PROMPTS), 30)
        finally:
            os.kill(rank1, signal.SIGKILL)
        thread.join(160)
        assert not thread.is_alive(), "a stream hung"
        assert [text for text, _ in results] == refs, results
        log = up.log()
        # Failed by rank 0's watchdog (the abort) or by the dead rank's closed gloo sockets,
        # whichever comes first (RankWatchdog's own test covers the abort).
        assert "node prefill-0 (prefill) failed" in log
        assert "restarted prefill-0" in log
        assert up.metric("duet_request_migrations_total", stage="prefill") >= 1
        (restarted,) = _rank_pids(up)  # the new node's rank 1, and nothing of the old one
        assert restarted != rank1 and not alive(rank1)
    finally:
        up.stop()
    assert not processes_mentioning(config), "a rank outlived the cluster"
