"""Sampler: greedy, top-k / top-p support sets, and per-request seeds."""

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams, draw, filter_probs, sample, skip_draw


def filter_one_row(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Reference: one row at a time (the sampler's former per-row loop)."""
    if 0 < top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        remove = probs.cumsum(-1) - probs >= top_p
        logits = logits.clone()
        logits[order[remove]] = float("-inf")
    return logits.softmax(-1)


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


@pytest.mark.parametrize("vocab_size", [1, 19, 4096 + 13])
def test_batched_filters_match_the_per_row_reference(vocab_size):
    """Rows with different temperature / top-k / top-p in one batch, as each alone."""
    gen = torch.Generator().manual_seed(vocab_size)
    params = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(top_p=0.9),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.5),
        SamplingParams(),
        SamplingParams(top_k=vocab_size + 5),
    ]
    logits = torch.randn(len(params), vocab_size, generator=gen) * 2
    got = filter_probs(logits, params)
    for i, p in enumerate(params):
        want = filter_one_row(logits[i] / p.temperature, p.top_k, p.top_p)
        assert torch.equal(got[i] > 0, want > 0), i
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-7)


def test_draw_is_torch_multinomial_and_skip_draw_keeps_the_stream_in_step():
    probs = torch.rand(4, 300) ** 6
    probs[:, ::3] = 0.0  # excluded tokens
    for seed in range(50):
        gens = [torch.Generator().manual_seed(seed * 4 + r) for r in range(4)]
        refs = [torch.Generator().manual_seed(seed * 4 + r) for r in range(4)]
        got = draw(probs, gens).tolist()
        assert got == [int(torch.multinomial(probs[r], 1, generator=refs[r])) for r in range(4)]
        assert all(probs[r, t] > 0 for r, t in enumerate(got))
    drawn, skipped = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    draw(probs[:1], [drawn])
    skip_draw(skipped, 300)
    assert torch.equal(torch.rand(5, generator=drawn), torch.rand(5, generator=skipped))


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_k": -5}, {"max_new_tokens": 0}]
)
def test_bad_parameters(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)
