"""A restarted attempt's random stream (`SamplingParams.draw_offset`): the router re-prefills a
preempted or moved request as prompt + the tokens already streamed, and the new attempt draws
on where the earlier one stopped, so a seeded request gives the same tokens whether or not it
was preempted. Checked on the nodes (prefill's first token and the decode steps) and offline,
against the uninterrupted request."""

import dataclasses

import pytest
from pd_harness import Pair

from control.sampling_params import SamplingParams
from router.state import RequestState, RouterRequest

PROMPT = [3, 44, 18, 250, 9, 71, 130]
# Hot enough that the random model's distribution is wide (at 1.0 it is peaked: 20 seeds gave 9
# distinct outputs), so a stream restarted at draw 0 lands elsewhere (as 20 seeds of 20 did).
PARAMS = SamplingParams(temperature=2.0, top_p=0.95, seed=11, max_new_tokens=12, ignore_eos=True)


def served(model, prompt, params):
    pair = Pair(model)
    assert pair.submit("a", prompt, params).ok
    pair.run_all()
    assert not pair.seen["a"].errors and pair.decode_pages_used == 0
    pair.close()
    return pair.seen["a"].output


@pytest.mark.parametrize("done", [1, 5])
def test_a_resumed_seeded_request_draws_the_tokens_it_would_have(model32, offline32, done):
    whole = served(model32, PROMPT, PARAMS)
    assert whole == offline32(PROMPT, PARAMS).token_ids
    rest = dataclasses.replace(PARAMS, max_new_tokens=12 - done, draw_offset=done)
    assert served(model32, PROMPT + whole[:done], rest) == whole[done:]
    assert offline32(PROMPT + whole[:done], rest).token_ids == whole[done:]
    # What the offset fixes: a stream restarted at draw 0 goes elsewhere.
    restarted = dataclasses.replace(rest, draw_offset=0)
    assert served(model32, PROMPT + whole[:done], restarted) != whole[done:]


def test_the_router_starts_a_new_attempt_after_the_tokens_already_drawn():
    req = RouterRequest("r", 1, PROMPT, PARAMS, frozenset())
    assert req.attempt_sampling.draw_offset == 0
    req.output_ids, req.num_output_tokens = [5, 6, 7], 3  # as the router counts them
    req.state = RequestState.DECODING
    req.restart(room=2)
    assert req.attempt_prompt_ids == PROMPT + [5, 6, 7]
    assert req.attempt_sampling.draw_offset == 3 and req.attempt_sampling.max_new_tokens == 9
