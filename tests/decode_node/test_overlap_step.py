"""The overlapped decode step (`decode_node.step_overlap`): while step n + 1's forward
runs, a helper thread emits step n's tokens and takes in new inputs.

The same tokens and logprobs as the in-order step; a request aborted while its row is in flight
keeps its pages out of anyone's hands until the forward is done (so a reservation taken in that
same window cannot be given them) and emits nothing more; a forward that raises fails its batch
and the node goes on."""

import pytest
from pd_harness import Pair

from control.sampling_params import SamplingParams
from decode_node.scheduler import DecodeState

PROMPTS = [[3, 44, 18, 250, 9, 71, 130], [5, 6, 7, 8, 9] * 3, [100, 200, 300], list(range(10, 21))]


def greedy(max_new, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True, **kw)


def mixed_params():
    return [
        greedy(9, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_new_tokens=12, ignore_eos=True),
        greedy(5),
        SamplingParams(temperature=1.1, top_k=20, seed=3, max_new_tokens=7, ignore_eos=True),
    ]


def serve(model, overlap: bool):
    pair = Pair(model, overlap=overlap, max_batch=3)  # four requests: one waits for a slot
    for i, (prompt, params) in enumerate(zip(PROMPTS, mixed_params(), strict=True)):
        assert pair.submit(f"r{i}", prompt, params).ok
    pair.run_all()
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    pair.close()
    return pair.seen


def test_overlapped_steps_give_the_in_order_tokens_and_logprobs(model32, offline32):
    overlapped, in_order = serve(model32, True), serve(model32, False)
    for i, (prompt, params) in enumerate(zip(PROMPTS, mixed_params(), strict=True)):
        a, b = overlapped[f"r{i}"], in_order[f"r{i}"]
        assert not a.errors and a.finish_reason == "length" == b.finish_reason
        assert a.output == b.output == offline32(prompt, params).token_ids, f"r{i}"
        assert a.logprobs == b.logprobs and a.top_ids == b.top_ids, f"r{i}"
    assert len(overlapped["r0"].logprobs) == 8  # r0 asked: one per decoded token


def _both_running(pair):
    requests = [pair.decode.scheduler.get(rid) for rid in ("a", "b")]
    return all(r is not None and r.state == DecodeState.RUNNING for r in requests)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "in-order"])
def test_an_abort_while_the_row_is_in_flight_holds_its_pages_until_the_forward_ends(
    model32, offline32, overlap
):
    pair = Pair(model32, overlap=overlap)
    for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1])):
        assert pair.submit(rid, prompt, greedy(20)).ok
    allocator = pair.decode.pool.allocator
    pair.run_until(lambda: _both_running(pair), "a and b decoding")  # the next step has both
    pages_of_a = set(pair.decode.scheduler.get("a").table.pages)
    pair.abort("a", prefill=False)
    # D takes the abort and then c's Reserve in one step, while (overlap) a's row is computed.
    assert pair.submit("c", PROMPTS[2], greedy(4)).ok
    pair.collect()
    tokens_of_a = len(pair.seen["a"].token_ids)  # (overlap: the last step's went out first)
    pages_of_c = set(pair.decode.scheduler.get("c").table.pages)
    if overlap:
        assert not pages_of_a & pages_of_c  # held back, then free once the forward ended
        assert allocator.num_held == 0 and all(allocator.num_holders(p) == 0 for p in pages_of_a)
    else:  # what the hold prevents: freed pages are the first handed out again
        assert pages_of_a & pages_of_c
    pair.run_until(lambda: pair.seen["b"].is_over and pair.seen["c"].is_over)
    assert len(pair.seen["a"].token_ids) == tokens_of_a and not pair.seen["a"].errors
    assert pair.decode.scheduler.get("a") is None
    for rid, prompt, params in (("b", PROMPTS[1], greedy(20)), ("c", PROMPTS[2], greedy(4))):
        assert pair.seen[rid].output == offline32(prompt, params).token_ids, rid
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    pair.close()


class FailsOnce:
    """The model, whose next forward raises."""

    def __init__(self, model):
        self.model, self.failed = model, False

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, fb, pool):
        if not self.failed:
            self.failed = True
            raise RuntimeError("the kernel broke")
        return self.model.forward(fb, pool)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "in-order"])
def test_a_forward_that_raises_fails_its_batch_and_the_node_goes_on(model32, offline32, overlap):
    pair = Pair(model32, overlap=overlap)
    pair.decode.model = FailsOnce(model32)
    assert pair.submit("a", PROMPTS[0], greedy(6)).ok
    pair.run_until(lambda: pair.seen["a"].is_over)
    (error,) = pair.seen["a"].errors
    assert error.stage == "decode" and "the kernel broke" in error.message
    assert pair.decode_pages_used == 0
    assert pair.submit("b", PROMPTS[1], greedy(6)).ok
    pair.run_until(lambda: pair.seen["b"].is_over)
    assert pair.seen["b"].output == offline32(PROMPTS[1], greedy(6)).token_ids
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    pair.close()
