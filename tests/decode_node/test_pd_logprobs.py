"""Logprobs through a real prefill/decode pair equal the teacher-forced fp32 log_softmax of the
offline model over prompt + output (raw logprobs: before penalties and temperature)."""

import pytest
from oracles import teacher_forced
from pd_harness import Pair

from control.sampling_params import SamplingParams

ATOL = 1e-4  # fp32, but batched chunks and the decode path sum in another order


@pytest.mark.parametrize("prompt", [[5, 9, 11, 200, 3, 3, 7, 42, 8, 1], [17, 4]])
def test_logprobs_equal_the_teacher_forced_log_softmax(model32, prompt):
    pair = Pair(model32, chunk_size=4)
    params = SamplingParams(
        temperature=0.0,
        max_new_tokens=6,
        ignore_eos=True,
        logprobs=3,
        prompt_logprobs=2,
        presence_penalty=1.0,  # changes the sampling, never the raw logprobs
    )
    pair.submit("r", prompt, params)
    pair.run_all()
    seen = pair.seen["r"]
    assert not seen.errors
    ids = prompt + seen.output
    ref = teacher_forced(model32, ids)  # ref[p] predicts ids[p + 1]
    # prompt logprobs: tokens 1 .. L-1
    first = seen.first
    assert len(first.prompt_logprobs) == len(prompt) - 1
    for p in range(1, len(prompt)):
        assert first.prompt_logprobs[p - 1] == pytest.approx(ref[p - 1, ids[p]].item(), abs=ATOL)
        assert first.prompt_top_ids[p - 1] == ref[p - 1].topk(2).indices.tolist()
        # the rank: the tokens at least as likely, within the values' tolerance
        x, row = ref[p - 1, ids[p]].item(), ref[p - 1]
        lowest, highest = int((row > x + ATOL).sum()) + 1, int((row >= x - ATOL).sum())
        assert lowest <= first.prompt_ranks[p - 1] <= highest
    # output logprobs: the first token's from P, the rest from D
    out_lps = first.logprob + seen.logprobs
    assert len(out_lps) == len(seen.output)
    for i, lp in enumerate(out_lps):
        pos = len(prompt) + i - 1
        assert lp == pytest.approx(ref[pos, ids[pos + 1]].item(), abs=ATOL)
    top = [first.top_ids, *seen.top_ids]
    for i, top_ids in enumerate(top):
        assert top_ids == ref[len(prompt) + i - 1].topk(3).indices.tolist()
    pair.close()


def test_no_logprobs_unless_asked(model32):
    pair = Pair(model32)
    pair.submit("r", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=3))
    pair.run_all()
    seen = pair.seen["r"]
    assert seen.first.logprob == [] and seen.first.prompt_logprobs == [] and seen.logprobs == []
    pair.close()
