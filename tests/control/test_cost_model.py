"""The online cost models: prior before data, the data's weights after, forgetting on change."""

import random

import pytest

from control.cost_model import DecodeCost, LinearCostModel, PrefillCost, prompt_features


def test_gives_the_prior_before_any_sample():
    model = LinearCostModel([0.5, 2.0], prior_weight=3.0, decay=0.9)
    assert model.num_samples == 0
    assert model.weights == pytest.approx([0.5, 2.0])
    assert model.predict([1.0, 3.0]) == pytest.approx(6.5)
    assert PrefillCost(prior=(1.0, 0.1, 0.0)).predict(10, 5) == pytest.approx(2.0)


def test_recovers_exact_weights_from_noiseless_samples():
    truth = [0.003, 2e-5, 4e-9]
    cost = PrefillCost(prior=(0.1, 0.0, 0.0), prior_weight=4.0, decay=0.9)
    rng = random.Random(0)
    for _ in range(400):
        new, prefix = rng.randint(1, 512), rng.randint(0, 4096)
        cost.observe(new, prefix, truth[0] + truth[1] * new + truth[2] * new * prefix)
    assert cost.num_samples == 400
    assert cost.model.weights == pytest.approx(truth, rel=1e-4)


def test_close_under_noise():
    truth = [0.002, 1e-4, 2e-7]
    cost = DecodeCost(prior=(0.0, 0.0, 0.0), decay=0.99)
    rng = random.Random(7)
    for _ in range(2000):
        batch = rng.randint(1, 64)
        context = batch * rng.randint(16, 1024)
        seconds = truth[0] + truth[1] * batch + truth[2] * context
        cost.observe(batch, context, seconds * (1 + rng.gauss(0, 0.05)))
    for batch, context in ((1, 100), (16, 8000), (64, 60000)):
        exact = truth[0] + truth[1] * batch + truth[2] * context
        assert cost.predict(batch, context) == pytest.approx(exact, rel=0.05)


def test_forgets_when_the_truth_changes():
    cost = DecodeCost(decay=0.9)
    rng = random.Random(1)

    def feed(a, b, c, n):
        for _ in range(n):
            batch = rng.randint(1, 32)
            context = batch * rng.randint(10, 500)
            cost.observe(batch, context, a + b * batch + c * context)

    feed(0.001, 1e-4, 1e-7, 300)
    assert cost.predict(8, 2000) == pytest.approx(0.001 + 8e-4 + 2e-4, rel=1e-3)
    feed(0.004, 4e-4, 4e-7, 300)  # the node got 4x slower (a noisy neighbour)
    assert cost.predict(8, 2000) == pytest.approx(4 * (0.001 + 8e-4 + 2e-4), rel=1e-3)


def test_never_predicts_negative():
    model = LinearCostModel([-1.0, 0.0], prior_weight=1.0, decay=1.0)
    assert model.predict([1.0, 0.0]) == 0.0


def test_prompt_features_match_chunk_by_chunk_sums():
    for prompt_len, cached, chunk in ((1000, 0, 256), (1000, 300, 256), (17, 16, 4), (5, 5, 3)):
        new = attention = forwards = 0
        for start in range(cached, prompt_len, chunk):
            size = min(chunk, prompt_len - start)
            new, attention, forwards = new + size, attention + size * start, forwards + 1
        assert prompt_features(prompt_len, cached, chunk) == (new, attention, forwards)


def test_predict_prompt_sums_its_chunks():
    cost = PrefillCost(prior=(0.01, 1e-3, 1e-6))
    chunks = [(256, 0), (256, 256), (88, 512)]
    expected = sum(0.01 + 1e-3 * n + 1e-6 * n * p for n, p in chunks)
    assert cost.predict_prompt(600, 0, 256) == pytest.approx(expected)
    assert cost.predict_prompt(600, 600, 256) == 0.0


def test_max_batch_within():
    cost = DecodeCost(prior=(0.01, 0.002, 1e-6))
    # 0.01 + B * (0.002 + 1e-6 * 1000) <= 0.05  ->  B <= 13.33
    assert cost.max_batch_within(0.05, 1000) == 13
    assert cost.max_batch_within(0.001, 1000) == 1  # never below one
    assert cost.max_batch_within(0.05, 1000, upper=4) == 4
    assert DecodeCost(prior=(0.01, 0.0, 0.0)).max_batch_within(0.05, 100, upper=64) == 64


def test_rejects_bad_samples():
    model = LinearCostModel([1.0, 1.0], prior_weight=1.0, decay=0.5)
    with pytest.raises(ValueError):
        model.observe([1.0], 1.0)
    with pytest.raises(ValueError):
        model.observe([1.0, float("nan")], 1.0)
    with pytest.raises(ValueError):
        LinearCostModel([1.0], prior_weight=0.0, decay=0.5)
