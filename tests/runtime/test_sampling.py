"""Sampler: greedy, top-k / top-p support sets, per-request seeds, and the batched sampler
against the one-row-at-a-time oracle (`oracles.sample_rows_one_by_one`)."""

import pytest
import torch
from oracles import sample_rows_one_by_one

from control.errors import InvalidRequestError
from control.sampling_params import SamplingParams
from native import reference_sampling
from runtime.penalties import TokenCounts
from runtime.sampling import draw, filter_probs, request_seed, sample


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
    assert sample(logits, params, [None] * 5, [0] * 5) == logits.argmax(-1).tolist()


def test_top_k_and_top_p_limit_the_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, -2.0, -3.0]])
    top_k = SamplingParams(temperature=1.0, top_k=2, seed=1)
    assert {sample(logits, [top_k], [1], [k])[0] for k in range(200)} <= {0, 1}
    # probs ~ [0.66, 0.24, 0.09, ...]: top_p 0.8 keeps exactly the first two tokens.
    top_p = SamplingParams(temperature=1.0, top_p=0.8, seed=1)
    seen = {sample(logits, [top_p], [1], [k])[0] for k in range(300)}
    assert seen == {0, 1}


def test_seed_gives_the_same_stream_in_any_batch():
    logits = torch.randn(3, 100)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(logits[1:2], [p], [1234], [k])[0] for k in range(20)]
    other = SamplingParams(temperature=0.7, seed=99)
    params = [other, p, SamplingParams(temperature=0.0)]
    batched = [sample(logits, params, [99, 1234, None], [3, k, 0])[1] for k in range(20)]
    assert alone == batched
    assert len(set(alone)) > 1  # the draw index moves the stream on


def test_request_seed_is_the_seed_or_a_fresh_random_one():
    assert request_seed(SamplingParams(seed=5)) == 5
    assert request_seed(SamplingParams(seed=5).for_sequence(0)) == 5
    assert request_seed(SamplingParams(seed=5, n=3).for_sequence(2)) == 7
    unseeded = {request_seed(SamplingParams()) for _ in range(8)}
    assert len(unseeded) == 8 and all(0 <= s < 2**63 for s in unseeded)


def test_draw_is_the_race_of_the_native_twin():
    probs = torch.rand(4, 300) ** 6
    probs[:, ::3] = 0.0  # excluded tokens
    seeds, draws = [11, 12, 2**63 - 1, 0], [0, 1, 5, 2**40]
    for step in range(30):
        got = draw(probs, seeds, [d + step for d in draws])
        want = reference_sampling.race_sample(
            probs, torch.tensor(seeds), torch.tensor(draws) + step
        )
        assert torch.equal(got, want)
        assert all(probs[r, t] > 0 for r, t in enumerate(got.tolist()))
    with pytest.raises(ValueError, match="needs a seed"):
        draw(probs, [1, None, 2, 3], draws)


def test_a_row_left_with_no_probability_takes_the_argmax():
    """temperature 1e-50 is 0 in fp32: logits / T overflow and the softmax is NaN. Such a row
    takes the temperature -> 0 limit, the argmax (as greedy rows), instead of failing the step."""
    logits = torch.randn(3, 70)
    params = [SamplingParams(temperature=1e-50), SamplingParams(seed=1), SamplingParams()]
    tokens = sample(logits, params, [5, 1, 2], [0, 0, 0])
    assert tokens[0] == int(logits[0].argmax())
    assert tokens == sample_rows_one_by_one(logits, params, [5, 1, 2], [0, 0, 0])


# ---- batched == one row at a time ------------------------------------------------------------
MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(top_p=0.9, repetition_penalty=1.3),
    SamplingParams(temperature=1.3, top_k=40, top_p=0.5, frequency_penalty=0.5),
    SamplingParams(min_p=0.1, presence_penalty=-0.7, logit_bias=((3, 2.0), (8, -5.0))),
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
    SamplingParams(temperature=0.9, min_tokens=4, stop_token_ids=(2,)),
    SamplingParams(top_k=1),  # greedy by top_k
    SamplingParams(temperature=2.0),
]


@pytest.mark.parametrize("vocab_size", [19, 1000 + 7, 102400])
def test_batched_sampling_equals_the_per_row_sampler(vocab_size):
    """Mixed greedy and random rows, filters, penalties, bias and min_tokens, over several
    steps of a decode batch (the past grown token by token): the same tokens as each row alone
    through the same math and the plain-torch race, for the same seeds and draw indices."""
    gen = torch.Generator().manual_seed(vocab_size)
    num_rows, eos = len(MIXED), (0,)
    prompts = [torch.randint(0, vocab_size, (6,), generator=gen).tolist() for _ in MIXED]
    outputs = [[int(torch.randint(0, vocab_size, (1,), generator=gen))] for _ in MIXED]
    seeds = [request_seed(p) for p in MIXED]  # random seeds, the same for both samplers
    counts = TokenCounts(num_rows, vocab_size)
    counts.start(range(num_rows), MIXED, prompts, outputs)
    stop_ids = [p.stop_ids(eos) for p in MIXED]
    for _ in range(6):
        logits = torch.randn(num_rows, vocab_size, generator=gen) * 3
        draws = [len(out) for out in outputs]
        past = counts.past(range(num_rows), MIXED, draws, stop_ids)
        got = sample(logits, MIXED, seeds, draws, past)
        assert got == sample_rows_one_by_one(logits, MIXED, seeds, draws, past)
        counts.add(range(num_rows), got)
        for out, token in zip(outputs, got, strict=True):
            out.append(token)


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


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_k": -5}, {"max_new_tokens": 0}]
)
def test_bad_parameters(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)
