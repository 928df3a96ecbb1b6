"""Two routers in front of one prefill/decode pair (in-process): each router's lease covers
only its own requests. The requests of a router that goes silent or restarts are dropped and
every page they held comes back, while the other router's requests run on to the offline
oracle's tokens."""

import time

import pytest
from pd_harness import Pair

from control.cluster_config import TimeoutConfig
from control.protocol import Heartbeat, Prefill, RouterPing, sampling_to_dict
from control.router_links import wire_prefix
from control.sampling_params import SamplingParams

PROMPT_A = [3, 44, 18, 250, 9, 71, 130, 5, 66, 301, 12, 40, 77, 8]
PROMPT_B = [5, 6, 7, 8, 9] * 5


def greedy(max_new):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)


def ping(pair: Pair, replica: int, router_id: str, lease_s: float) -> None:
    for inbox in (pair.p_in, pair.d_in):
        inbox.put(RouterPing(router_id, lease_s, replica))


@pytest.fixture
def pair(model):
    pair = Pair(model, d_num_pages=128, timeouts=TimeoutConfig(heartbeat_s=0.05, lease_s=60.0))
    yield pair
    pair.close()


@pytest.mark.parametrize("how", ["lease", "restart"])
def test_a_lost_router_takes_only_its_own_requests(pair, offline, how):
    mine, theirs = "cmpl-a", wire_prefix(1) + "cmpl-b"
    ping(pair, 0, "router-0", 60.0)
    ping(pair, 1, "router-1", 0.2 if how == "lease" else 60.0)
    assert pair.submit(mine, PROMPT_A, greedy(12)).ok
    assert pair.submit(theirs, PROMPT_B, greedy(200)).ok
    pair.run_until(lambda: pair.seen[theirs].token_ids, "router 1's request to decode")
    assert pair.seen[mine].finish_reason is None  # both still running
    if how == "lease":
        time.sleep(0.3)  # router 1 is silent past its lease
    else:
        ping(pair, 1, "router-1-again", 60.0)  # a new router at replica 1's place
    pair.run_until(lambda: pair.seen[mine].is_over, "router 0's request to end")
    pair.settle(2)
    assert pair.seen[mine].output == offline(PROMPT_A, greedy(12))
    assert not pair.seen[mine].errors
    lost = pair.seen[theirs]
    assert lost.finish_reason is None and len(lost.token_ids) < 199  # dropped mid-stream
    assert not pair.decode.scheduler.requests and not pair.prefill.scheduler.requests
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    # A restarted router is told of both nodes again; a lapsed lease tells nobody.
    assert sorted(r.node for r in pair.readies) == (["d", "p"] if how == "restart" else [])


def test_prefill_numbering_is_reported_per_router(pair):
    sampling = sampling_to_dict(greedy(1))
    endpoint = pair.receiver.endpoint
    pair.p_in.put(Prefill("cmpl-a", 1, PROMPT_A, sampling, endpoint, 5.0, seq=4))
    pair.p_in.put(Prefill(wire_prefix(2) + "cmpl-b", 2, PROMPT_B, sampling, endpoint, 5.0, seq=9))
    pair.prefill.step()
    hb = pair.prefill.heartbeat()
    assert isinstance(hb, Heartbeat) and hb.prefill_seqs == [4, 0, 9]
    ping(pair, 2, "r2", 60.0)
    pair.prefill.step()
    ping(pair, 2, "r2-restarted", 60.0)
    pair.prefill.step()
    assert pair.prefill.heartbeat().prefill_seqs == [4]  # the new router 2 numbers from 1
