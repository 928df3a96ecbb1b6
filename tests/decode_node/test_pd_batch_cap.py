"""The decode node caps its running batch to keep the predicted step within tpot_ms (SLA, issue
10 part 2): with a TPOT no step can meet the batch is one request, and every request still
finishes with the offline generator's tokens; the nodes' heartbeats carry their timings."""

import pytest
from pd_harness import Pair

from control.cluster_config import SlaConfig
from control.sampling_params import SamplingParams

PROMPTS = [[3, 44, 18, 250, 9, 71, 130], [5, 6, 7, 8, 9] * 3, [100, 200, 300], list(range(10, 21))]


def greedy(max_new=6):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)


def run_and_watch_batches(pair):
    """Submits every prompt at once, runs them all; the largest decode batch seen."""
    sizes = []
    schedule = pair.decode.scheduler.schedule

    def watched(batch_cap=None):
        batch = schedule(batch_cap)
        sizes.append(len(batch))
        return batch

    pair.decode.scheduler.schedule = watched
    for i, prompt in enumerate(PROMPTS):
        assert pair.submit(f"r{i}", prompt, greedy()).ok
    pair.run_all()
    return max(sizes)


@pytest.mark.parametrize("tpot_ms, capped", [(1e-6, True), (None, False)])
def test_tiny_tpot_caps_the_batch_at_one_and_every_request_finishes(
    model, offline, tpot_ms, capped
):
    sla = SlaConfig(tpot_ms=tpot_ms) if tpot_ms else None
    pair = Pair(model, max_batch=4, sla=sla)
    try:
        largest = run_and_watch_batches(pair)
        # Without a cap the same requests do share steps: the cap is what keeps them apart.
        assert (largest == 1) if capped else (largest > 1)
        for i, prompt in enumerate(PROMPTS):
            seen = pair.seen[f"r{i}"]
            assert not seen.errors and seen.finish_reason == "length"
            assert seen.output == offline(prompt, greedy())
        pair.settle()
        assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    finally:
        pair.close()


def test_cap_off_in_the_sla_means_no_cap(model):
    pair = Pair(model, sla=SlaConfig(tpot_ms=1e-6, cap_decode_batch=False))
    try:
        assert pair.decode.batch_cap() is None
    finally:
        pair.close()


def test_heartbeats_carry_timing_samples_and_queued_work(model):
    pair = Pair(model)
    try:
        assert pair.submit("r0", PROMPTS[1], greedy()).ok
        pair.run_all()
        pair.settle(2)
        prefill = [s for hb in pair.heartbeats if hb.role == "prefill" for s in hb.timing_samples]
        decode = [s for hb in pair.heartbeats if hb.role == "decode" for s in hb.timing_samples]
        # 15 prompt tokens in chunks of 4 (one request: one chunk a forward): 4 forwards.
        assert [s[:2] for s in prefill] == [[4, 0], [4, 16], [4, 32], [3, 36]]
        # 5 decode steps of one request, its context growing by one token a step.
        assert [s[:2] for s in decode] == [[1, 16 + i] for i in range(5)]
        assert all(s[2] > 0 for s in prefill + decode)
        assert pair.decode.step_cost.num_samples == 5
    finally:
        pair.close()
