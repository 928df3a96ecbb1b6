"""Counter-based sampling (native/csrc/sampling.cpp) against its plain-torch twin
(native/reference_sampling.py), bit for bit on every ISA level (the `isa` fixture); the twin's
hash against plain Python integers and its -log against float64; and the race's statistics:
over many counters (or seeds) the tokens follow the probabilities, chi-square bounded with fixed
seeds (deterministic: no run can be unlucky)."""

import math

import pytest
import torch

from native import _C, ops
from native import reference_sampling as ref

pytestmark = pytest.mark.skipif(_C is None, reason="native extension not built")

MASK64 = (1 << 64) - 1


def python_uniform(seed: int, draw: int, index: int) -> float:
    """The stream of native/reference_sampling.py's docstring in plain Python integers."""

    def mix64(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    key = mix64(mix64((seed & MASK64) ^ 0x2545F4914F6CDD1D) ^ (draw & MASK64))
    bits = mix64((key + (index & MASK64) * 0x9E3779B97F4A7C15) & MASK64)
    return (2 * (bits >> 41) + 1) * 2.0**-24


def streams(rows: int, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rows + salt)
    seeds = torch.randint(0, 2**62, (rows,), generator=gen) * 2 + torch.randint(0, 2, (rows,))
    draws = torch.randint(0, 5000, (rows,), generator=gen)
    return seeds, draws


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


# ---- the stream -------------------------------------------------------------------------------
def test_twin_hash_equals_plain_python_integers():
    seeds = torch.tensor([0, 1, 2**63 - 1, 12345, -1, 7])  # -1: the bits of 2^64 - 1
    draws = torch.tensor([0, 5, 7, 1 << 40, 3, -2])
    for index in (0, 1, -1, -7, 102399, 2**40):
        want = [python_uniform(int(s), int(d), index) for s, d in zip(seeds, draws, strict=True)]
        assert ref.random_uniform(seeds, draws, index).double().tolist() == want


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_uniforms_and_exponentials_equal_the_twin_bitwise(isa, rows):
    seeds, draws = streams(rows)
    for index in (0, 5, -1, -2, 8191, 8192, 2**33 + 1):
        got = ops.random_uniform(seeds, draws, index)
        assert torch.equal(got, ref.random_uniform(seeds, draws, index)), index
        assert bool(((got > 0) & (got < 1)).all())
    for vocab in (1, 15, 16, 17, 8192 + 3, 3 * 8192 + 5):
        got = ops.race_exponentials(seeds, draws, vocab)
        assert torch.equal(bits(got), bits(ref.race_exponentials(seeds, draws, vocab))), vocab


def test_race_divides_by_neg_log_of_the_uniforms(isa):
    """E[v] is -log of random_uniform at index v: what the integrator's acceptance tests read."""
    seeds, draws = streams(4)
    e = ops.race_exponentials(seeds, draws, 40)
    for v in (0, 1, 17, 39):
        assert torch.equal(e[:, v], ref.neg_log(ops.random_uniform(seeds, draws, v)))


def test_neg_log_is_accurate_and_positive_on_every_uniform():
    """All 2^23 values U can take: E > 0, finite, within 1.2e-7 relative of float64 -log."""
    u = (2 * torch.arange(2**23) + 1).float() * 2.0**-24
    e = ref.neg_log(u).double()
    want = -u.double().log()
    assert bool((e > 0).all()) and bool(e.isfinite().all())
    assert ((e - want).abs() / want).max().item() < 1.2e-7


# ---- the race: kernel vs twin ------------------------------------------------------------------
def awkward_probs(rows: int, vocab: int, salt: int = 0) -> torch.Tensor:
    """Unnormalized rows: peaked, flat, sparse (many zeros), and a one-hot."""
    gen = torch.Generator().manual_seed(rows * 7919 + vocab + salt)
    probs = torch.rand(rows, vocab, generator=gen) ** 8
    probs[::3, 1::2] = 0.0
    if rows > 1:
        probs[1] = 1.0  # flat: the race alone decides
    if rows > 2:
        probs[2] = 0.0
        probs[2, vocab // 2] = 0.25
    return probs


@pytest.mark.parametrize(
    "rows,vocab", [(1, 1), (1, 19), (3, 4096 + 13), (17, 8192 + 1), (5, 3 * 8192 + 16), (0, 7)]
)
def test_race_sample_equals_the_twin(isa, rows, vocab):
    probs = awkward_probs(rows, vocab)
    seeds, draws = streams(rows)
    got = ops.race_sample(probs, seeds, draws)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, ref.race_sample(probs, seeds, draws))
    assert bool((probs[torch.arange(rows), got] > 0).all())


@pytest.mark.parametrize("rows", [1, 8, 33])
def test_large_vocab_over_many_draws_equals_the_twin(isa, rows):
    """DeepSeek's vocabulary, rows spread over chunks and threads, 1 and 2 threads alike."""
    vocab = 102400 if isa != "portable" else 20000 + 7
    probs = torch.softmax(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)), -1)
    for step in range(3):
        seeds, draws = streams(rows, salt=step)
        want = ref.race_sample(probs, seeds, draws)
        assert torch.equal(ops.race_sample(probs, seeds, draws), want)
        threads = _C.get_num_threads()
        try:
            ops.set_num_threads(1)
            assert torch.equal(ops.race_sample(probs, seeds, draws), want)
        finally:
            ops.set_num_threads(threads)


def test_ties_take_the_lowest_index_across_chunks(isa):
    """Infinite weights tie at inf whatever E is: the first one wins, also across task chunks."""
    probs = torch.rand(3, 3 * 8192)
    probs[0, [5, 9]] = float("inf")
    probs[1, [8193, 3, 20000]] = float("inf")
    probs[2, [16390, 16391]] = float("inf")
    seeds, draws = streams(3)
    for fn in (ops.race_sample, ref.race_sample):
        assert fn(probs, seeds, draws).tolist() == [5, 3, 16390]


def test_a_row_without_positive_probability_gives_minus_one(isa):
    probs = torch.rand(3, 50)
    seeds, draws = streams(3)
    for bad in (torch.zeros(50), torch.full((50,), float("nan")), -torch.rand(50)):
        probs[1] = bad
        for fn in (ops.race_sample, ref.race_sample):
            tokens = fn(probs, seeds, draws)
            assert tokens[1].item() == -1 and bool((tokens[[0, 2]] >= 0).all())
    probs[1, :] = 0.0
    probs[1, 7] = float("nan")  # a NaN never wins; the one positive weight does
    probs[1, 8] = 1e-30
    for fn in (ops.race_sample, ref.race_sample):
        assert fn(probs, seeds, draws)[1].item() == 8


def test_arguments_are_checked():
    probs = torch.rand(2, 10)
    seeds, draws = streams(2)
    with pytest.raises(ValueError, match="probs must be fp32"):
        ops.race_sample(probs.double(), seeds, draws)
    with pytest.raises(ValueError, match="seeds must be int64 \\[2\\]"):
        ops.race_sample(probs, seeds.int(), draws)
    with pytest.raises(ValueError, match="counters must be int64 \\[2\\]"):
        ops.race_sample(probs, seeds, draws[:1])
    strided = torch.rand(10, 2).t()  # not contiguous: copied, same tokens
    assert torch.equal(
        ops.race_sample(strided, seeds, draws), ref.race_sample(strided, seeds, draws)
    )
    tokens = torch.empty(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="race_sample: counters is int32, expected int64"):
        _C.race_sample(
            probs.data_ptr(),
            seeds.data_ptr(),
            draws.int().data_ptr(),
            tokens.data_ptr(),
            2,
            10,
            [0, 4, 3, 4],
        )


# ---- statistics --------------------------------------------------------------------------------
def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of token counts against probabilities (zero-probability tokens must
    have no count), and its degrees of freedom."""
    n = counts.sum().item()
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support].double() / probs.sum().item() * n
    stat = ((counts[support].double() - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


def bound(dof: int) -> float:
    """A chi-square bound a correct sampler exceeds with probability ~1e-6 (Wilson-Hilferty)."""
    z = 4.75
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


PROBS = torch.tensor([0.3, 0.2, 0.0, 0.15, 0.1, 0.08, 0.07, 0.05, 0.03, 0.015, 0.005, 0.0])


@pytest.mark.parametrize("over", ["counters", "seeds"])
def test_tokens_follow_the_probabilities(isa, over):
    """One request's draws 0 .. N-1 (decode), or N requests' first draws (N seeds, draw 0)."""
    n = 60000
    probs = PROBS[None].expand(n, -1).contiguous() * 3.0  # unnormalized
    ramp = torch.arange(n)
    seeds, draws = (torch.full((n,), 42), ramp) if over == "counters" else (ramp, torch.zeros(n))
    tokens = ops.race_sample(probs, seeds, draws.long())
    stat, dof = chi_square(torch.bincount(tokens, minlength=len(PROBS)), PROBS)
    assert stat < bound(dof), (stat, dof)


def test_consecutive_draws_are_independent(isa):
    """Pairs (token at draw c, token at draw c + 1) of one seed follow the product distribution."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 40001
    tokens = ops.race_sample(
        probs[None].expand(n, -1).contiguous(), torch.full((n,), 7), torch.arange(n)
    )
    pairs = torch.bincount(tokens[:-1] * 4 + tokens[1:], minlength=16)
    stat, dof = chi_square(pairs, torch.outer(probs, probs).flatten())
    assert stat < bound(dof), stat


def test_a_large_vocabulary_follows_its_probabilities(isa):
    """V = 4096 + 13 with a skewed distribution: counts of 24 equal-mass token groups."""
    vocab, n = 4096 + 13, 12000
    probs = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(11)) * 2, -1)
    tokens = ops.race_sample(
        probs[None].expand(n, -1).contiguous(), torch.arange(n) + 99, torch.full((n,), 3)
    )
    group = (probs.cumsum(0) * 24).long().clamp(max=23)  # [V]: each token's mass bucket
    mass = torch.zeros(24, dtype=torch.float64).index_add_(0, group, probs.double())
    counts = torch.bincount(group[tokens], minlength=24)
    stat, dof = chi_square(counts, mass)
    assert stat < bound(dof), stat
