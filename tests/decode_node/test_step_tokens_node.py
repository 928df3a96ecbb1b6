"""The decode node sends one StepTokens per decode step holding every request of the step (not one
message per request per token), in-process (queues, tiny model): each step with B running
requests sends exactly one message of B entries, the streams it adds up to equal offline
generation, a request's logprobs ride in its own entry, and several tokens of one request in
one step (speculative decoding) travel as one entry with their logprobs aligned."""

import pytest
from pd_harness import Pair

from control.logprobs import TokenLogprobs
from control.protocol import Preempted, RequestTokens, StepTokens
from control.sampling_params import SamplingParams
from decode_node.scheduler import StepOutput

PROMPTS = [[3, 44, 18, 250, 9, 71], [5, 6, 7, 8, 9] * 3, [100, 200, 300], list(range(10, 24))]
LENGTHS = [7, 4, 9, 6]


def greedy(max_new, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True, **kw)


@pytest.fixture(params=[False, True], ids=["in-order", "overlap"])
def pair(model32, request):  # float32: four decode together exactly as offline (bf16 may flip)
    pair = Pair(model32, max_batch=4, overlap=request.param)
    yield pair
    pair.close()


def record_steps(pair):
    """[(ids of the step's batch, the StepTokens its tokens went out in)] for every decode step
    (with overlap, a step's tokens go out while the next step's forward runs)."""
    steps, finish, emit = [], pair.decode._finish_step, pair.decode._emit
    finished = []  # (batch ids, outputs) of the steps whose tokens are not out yet

    def finish_step(step, *forward_result):
        result = finish(step, *forward_result)
        finished.append(([r.request_id for r in step.batch], result[0]))
        return result

    def emit_and_record(outputs, logprobs_of=None):
        before = len(pair.d_out.messages)
        emit(outputs, logprobs_of)
        if finished and outputs is finished[0][1]:
            sent = [m for m in pair.d_out.messages[before:] if isinstance(m, StepTokens)]
            steps.append((finished.pop(0)[0], sent))

    pair.decode._finish_step, pair.decode._emit = finish_step, emit_and_record
    return steps


def test_each_step_sends_one_message_with_every_request_of_the_batch(pair, offline32):
    steps = record_steps(pair)
    params = [greedy(n, logprobs=2 if i == 1 else None) for i, n in enumerate(LENGTHS)]
    for i, (prompt, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        assert pair.submit(f"r{i}", prompt, sp).ok
    pair.run_all()
    assert steps and max(len(batch) for batch, _ in steps) == 4  # all four ran together
    for batch, sent in steps:
        (msg,) = sent  # exactly one message per step, whatever the batch size
        assert msg.request_ids == batch  # B entries, in the batch's order
    for i, (prompt, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        seen = pair.seen[f"r{i}"]
        assert not seen.errors and seen.output == offline32(prompt, sp).token_ids, f"r{i}"
        assert seen.finish_reason == "length"
        # Only r1 asked for logprobs: one per token it decoded, none for the others.
        assert len(seen.logprobs) == (len(seen.token_ids) if i == 1 else 0), f"r{i}"
    assert pair.decode_pages_used == 0


def test_several_tokens_of_a_request_in_one_step_are_one_entry(pair):
    """What speculative decoding emits: a request's accepted tokens of one step together,
    with one logprob entry per token."""
    lps = [TokenLogprobs(-0.5, [4, 2], [-0.5, -1.0]), TokenLogprobs(-0.25, [5], [-0.25])]
    outputs = [
        StepOutput("x", [4, 5], None),
        StepOutput("y", [7], "stop"),
        StepOutput("z", [], "length"),
    ]
    pair.decode._emit(outputs, {"x": lps, "z": lps[:1]})  # z emitted no token: no logprobs
    (msg,) = pair.d_out.take()
    assert msg.outputs() == [
        RequestTokens("x", [4, 5], None, [-0.5, -0.25], [[4, 2], [5]], [[-0.5, -1.0], [-0.25]]),
        RequestTokens("y", [7], "stop"),
        RequestTokens("z", [], "length"),
    ]


def test_a_preempted_request_is_reported_after_the_step_with_its_tokens(model):
    """On-demand KV with a pool too small for both: the request preempted is reported after
    every StepTokens that carried its tokens (the router then has its whole output)."""
    pair = Pair(model, d_num_pages=8, max_batch=2, kv_headroom_tokens=0)
    try:
        for rid, prompt in (("a", PROMPTS[1]), ("b", PROMPTS[3])):
            assert pair.submit(rid, prompt, greedy(20)).ok
        order = []
        original = pair.d_out.send

        def send(msg):
            if isinstance(msg, StepTokens | Preempted):
                order.append(msg)
            return original(msg)

        pair.d_out.send = send
        pair.run_until(lambda: any(s.preempted for s in pair.seen.values()), "a preemption")
        (preempted,) = [m for m in order if isinstance(m, Preempted)]
        before = order[: order.index(preempted)]
        streamed = sum(
            len(ids)
            for m in before
            for rid, ids in zip(m.request_ids, m.token_ids, strict=True)
            if rid == preempted.request_id
        )
        assert preempted.num_tokens == streamed + 1  # P's first token and all of D's before it
        after = order[order.index(preempted) + 1 :]
        assert all(preempted.request_id not in m.request_ids for m in after)
    finally:
        pair.close()
