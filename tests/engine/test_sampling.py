"""Sampler: greedy, top-k / top-p support sets, and per-request seeds."""

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams, sample


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    params = [SamplingParams(temperature=0.0)] * 5
    assert sample(logits, params, [None] * 5) == logits.argmax(-1).tolist()


def test_top_k_and_top_p_limit_the_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, -2.0, -3.0]])
    top_k = SamplingParams(temperature=1.0, top_k=2, seed=1)
    gen = top_k.make_generator()
    assert {sample(logits, [top_k], [gen])[0] for _ in range(200)} <= {0, 1}
    # probs ~ [0.66, 0.24, 0.09, ...]: top_p 0.8 keeps exactly the first two tokens.
    top_p = SamplingParams(temperature=1.0, top_p=0.8, seed=1)
    gen = top_p.make_generator()
    seen = {sample(logits, [top_p], [gen])[0] for _ in range(300)}
    assert seen == {0, 1}


def test_seed_gives_the_same_stream_in_any_batch():
    logits = torch.randn(3, 100)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(logits[1:2], [p], [g])[0] for g in [p.make_generator()] for _ in range(20)]
    other = SamplingParams(temperature=0.7, seed=99)
    gens = [other.make_generator(), p.make_generator(), None]
    params = [other, p, SamplingParams(temperature=0.0)]
    batched = [sample(logits, params, gens)[1] for _ in range(20)]
    assert alone == batched


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_k": -5}, {"max_new_tokens": 0}]
)
def test_bad_parameters(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)
