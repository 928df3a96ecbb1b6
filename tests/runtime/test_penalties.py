"""logit_bias, min_tokens, the penalties and min_p, batched over rows with different params,
against independent oracles: Hugging Face transformers' logits processors on the same logits, a
plain-torch loop for presence/frequency (OpenAI's definition), a direct add for logit_bias; and
distributional checks over many seeds where sampling is random."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from control.errors import InvalidRequestError
from control.protocol import (
    ProtocolError,
    Reserve,
    decode,
    encode,
    sampling_from_dict,
    sampling_to_dict,
)
from control.sampling_params import SamplingParams
from runtime.penalties import PastTokens, TokenCounts, process_logits
from runtime.sampling import filter_probs, sample

V = 50
EOS = (3,)


# ---- oracles ---------------------------------------------------------------------------------
def presence_frequency_oracle(row: torch.Tensor, output: list[int], presence, frequency):
    """OpenAI's definition, one token at a time."""
    row = row.clone()
    for token in set(output):
        row[token] -= frequency * output.count(token) + presence
    return row


def hf(processor, row: torch.Tensor, input_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([input_ids or [0]], dtype=torch.long)
    return processor(ids, row[None].clone())[0]


def history(params, prompts, outputs):
    """The PastTokens a decode step sees, built incrementally as the decode node builds it: each
    row started with its prompt and first token, then one `add` per further token."""
    counts = TokenCounts(len(params) + 3, V)
    slots = [len(params) + 2 - i for i in range(len(params))]  # not the row order
    counts.start(slots, params, prompts, [out[:1] for out in outputs])
    for step in range(1, max(map(len, outputs))):
        rows = [i for i, out in enumerate(outputs) if step < len(out)]
        counts.add([slots[i] for i in rows], [outputs[i][step] for i in rows])
    stop_ids = [p.stop_ids(EOS) for p in params]
    return counts.past(slots, params, [len(o) for o in outputs], stop_ids)


def dense(past: PastTokens, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, token) pairs as [B, V] output counts and a [B, V] "seen" mask."""
    counts = torch.zeros(num_rows, V)
    seen = torch.zeros(num_rows, V, dtype=torch.bool)
    counts[past.rows, past.token_ids] = past.output_counts
    seen[past.rows, past.token_ids] = True
    return counts, seen


def random_case(seed: int, num_rows: int = 6):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, V, generator=gen) * 3
    prompts = [
        torch.randint(0, V, (int(n),), generator=gen).tolist() for n in range(3, 3 + num_rows)
    ]
    outputs = [torch.randint(0, V, (n,), generator=gen).tolist() for n in range(1, 1 + num_rows)]
    return logits, prompts, outputs


# ---- each processor against its oracle ------------------------------------------------------
def test_repetition_penalty_matches_hf_over_prompt_and_output():
    logits, prompts, outputs = random_case(0)
    penalties = [1.3, 1.0, 0.7, 2.0, 1.0, 1.05]  # 1.0: off (a row without penalties)
    params = [SamplingParams(repetition_penalty=r) for r in penalties]
    got = process_logits(logits, params, history(params, prompts, outputs))
    for i, r in enumerate(penalties):
        want = hf(RepetitionPenaltyLogitsProcessor(r), logits[i], prompts[i] + outputs[i])
        assert torch.equal(got[i], want), i


def test_presence_and_frequency_match_the_loop_oracle_over_output_only():
    logits, prompts, outputs = random_case(1)
    pairs = [(0.5, 0.0), (0.0, 0.8), (-1.5, 2.0), (0.0, 0.0), (2.0, -2.0), (0.3, 0.3)]
    params = [SamplingParams(presence_penalty=p, frequency_penalty=f) for p, f in pairs]
    got = process_logits(logits, params, history(params, prompts, outputs))
    for i, (p, f) in enumerate(pairs):
        want = presence_frequency_oracle(logits[i], outputs[i], p, f)
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-5)


def test_all_penalties_together_in_vllm_order():
    logits, prompts, outputs = random_case(2)
    params = [
        SamplingParams(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0),
        SamplingParams(presence_penalty=1.0),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(),
    ]
    got = process_logits(logits, params, history(params, prompts, outputs))
    for i, p in enumerate(params):
        rep = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
        want = hf(rep, logits[i], prompts[i] + outputs[i])
        want = presence_frequency_oracle(want, outputs[i], p.presence_penalty, p.frequency_penalty)
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-5)


def test_logit_bias_is_a_direct_add():
    logits = torch.randn(4, V)
    biases = [{}, {0: 5.0, 7: -100.0}, {49: 100.0}, {1: 0.25, 2: -0.5, 3: 1.0}]
    params = [SamplingParams(logit_bias=tuple(b.items())) for b in biases]
    got = process_logits(logits, params, None)
    for i, bias in enumerate(biases):
        want = logits[i].clone()
        for token, value in bias.items():
            want[token] += value
        assert torch.equal(got[i], want), i
        # HF's SequenceBiasLogitsProcessor with one-token sequences is the same thing
        if bias:
            proc = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
            torch.testing.assert_close(got[i], hf(proc, logits[i], [0]), rtol=0, atol=1e-6)
    assert process_logits(logits, [SamplingParams()] * 4, None) is logits  # nothing to do


def test_min_tokens_matches_hf_min_new_tokens():
    logits, prompts, outputs = random_case(3)
    params = [
        SamplingParams(min_tokens=4),  # 1 generated: held
        SamplingParams(min_tokens=2),  # 2 generated: free
        SamplingParams(min_tokens=5, stop_token_ids=(10, 11)),  # 3 generated: held, 3 ids
        SamplingParams(min_tokens=9, stop_token_ids=(12,), ignore_eos=True),  # EOS not held
        SamplingParams(),
        SamplingParams(min_tokens=7, stop_token_ids=(10**6,)),  # outside the vocabulary
    ]
    got = process_logits(logits, params, history(params, prompts, outputs))
    for i, p in enumerate(params):
        stop = sorted(s for s in p.stop_ids(EOS) if s < V)
        proc = MinNewTokensLengthLogitsProcessor(len(prompts[i]), p.min_tokens, stop)
        want = hf(proc, logits[i], prompts[i] + outputs[i])
        assert torch.equal(got[i], want), i
    assert torch.isinf(got[3, 12]) and not torch.isinf(got[3, EOS[0]])


def test_first_token_sees_the_prompt_only():
    """As the prefill node samples: nothing generated, so presence/frequency do nothing and
    min_tokens holds the stop tokens; the repetition penalty reads the prompt."""
    logits = torch.randn(3, V) * 2
    prompts = [[1, 2, 2, 9], [5], [40, 41]]
    params = [
        SamplingParams(repetition_penalty=1.7, presence_penalty=2.0, frequency_penalty=2.0),
        SamplingParams(min_tokens=1, stop_token_ids=(6,)),
        SamplingParams(presence_penalty=1.0),
    ]
    past = PastTokens.of_prompts(prompts, params, EOS, V)
    got = process_logits(logits, params, past)
    assert torch.equal(got[0], hf(RepetitionPenaltyLogitsProcessor(1.7), logits[0], prompts[0]))
    want = logits[1].clone()
    want[[3, 6]] = float("-inf")
    assert torch.equal(got[1], want) and torch.equal(got[2], logits[2])


def test_min_p_matches_hf_after_temperature_and_top_k():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, V, generator=gen) * 2
    params = [
        SamplingParams(min_p=0.1),
        SamplingParams(min_p=0.5, temperature=0.7),
        SamplingParams(min_p=0.05, temperature=1.5, top_k=10),
        SamplingParams(),  # no min_p in the same batch
        SamplingParams(min_p=1.0),  # the top token alone
    ]
    got = filter_probs(logits, params)
    for i, p in enumerate(params):
        want = TemperatureLogitsWarper(p.temperature)(None, logits[i : i + 1].clone())
        if p.top_k > 0:
            want = TopKLogitsWarper(p.top_k)(None, want)
        if p.min_p > 0:
            want = MinPLogitsWarper(p.min_p)(None, want)
        want = want[0].softmax(-1)
        assert torch.equal(got[i] > 0, want > 0), i  # the same support
        torch.testing.assert_close(got[i] / got[i].sum(), want, rtol=1e-5, atol=1e-7)
    assert (got[4] > 0).sum() == 1


def test_greedy_rows_take_the_argmax_after_bias_penalties_and_min_tokens():
    logits = torch.zeros(4, V)
    logits[:, 3] = 5.0  # EOS is the argmax
    logits[:, 20] = 4.0
    params = [
        SamplingParams(temperature=0.0, logit_bias=((30, 100.0),)),
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),  # EOS in the prompt: 5 -> 2.5
        SamplingParams(temperature=0.0),
    ]
    past = PastTokens.of_prompts([[1], [1], [3], [1]], params, EOS, V)
    assert sample(logits, params, [None] * 4, [0] * 4, past) == [30, 20, 20, 3]


# ---- the incremental counts -----------------------------------------------------------------
def test_token_counts_equal_a_rescan_as_requests_join_and_leave():
    """Slots reused by later requests, rows without penalties mixed in: after every step the
    rows of the requests with penalties equal a bincount of their whole output."""
    gen = torch.Generator().manual_seed(5)
    counts = TokenCounts(4, V)
    running: dict[int, tuple[SamplingParams, list[int], list[int]]] = {}
    for step in range(60):
        for slot in range(4):
            if slot not in running or torch.rand(1, generator=gen).item() < 0.15:
                p = SamplingParams(repetition_penalty=1.1) if slot % 2 else SamplingParams()
                prompt = torch.randint(0, V, (5,), generator=gen).tolist()
                first = [int(torch.randint(0, V, (1,), generator=gen))]
                running[slot] = (p, prompt, first)
                counts.start([slot], [p], [prompt], [first])
        slots = sorted(running)
        tokens = torch.randint(0, V, (len(slots),), generator=gen).tolist()
        counts.add(slots, tokens)
        for slot, token in zip(slots, tokens, strict=True):
            running[slot][2].append(token)
        params = [running[s][0] for s in slots]
        past = counts.past(slots, params, [0] * len(slots), [frozenset()] * len(slots))
        got_counts, got_seen = dense(past, len(slots))
        for row, slot in enumerate(slots):
            p, prompt, output = running[slot]
            if p.uses_penalties:
                want = torch.bincount(torch.tensor(output), minlength=V).float()
                assert torch.equal(got_counts[row], want), (step, slot)
                assert got_seen[row].nonzero().flatten().tolist() == sorted(set(prompt + output))
            else:
                assert not got_seen[row].any()  # no pairs for a row without penalties
        pairs = set(zip(past.rows.tolist(), past.token_ids.tolist(), strict=True))
        assert len(pairs) == len(past.rows)  # each seen token once


def test_nothing_is_allocated_without_penalties():
    counts = TokenCounts(8, V)
    counts.start([0, 1], [SamplingParams(), SamplingParams(min_p=0.5)], [[1], [2]], [[3], [4]])
    counts.add([0, 1], [5, 6])
    assert counts.counts is None
    past = counts.past([0, 1], [SamplingParams()] * 2, [2, 2], [frozenset()] * 2)
    assert past.rows.numel() == past.token_ids.numel() == past.output_counts.numel() == 0


# ---- random sampling, over many seeds -------------------------------------------------------
def draws(logits_row, params: SamplingParams, num_seeds: int) -> torch.Tensor:
    """One token per seed 0 .. num_seeds - 1, each its stream's first draw (the first token of
    a request), in one batch."""
    logits = logits_row[None].expand(num_seeds, -1)
    rows = [params] * num_seeds
    return torch.tensor(sample(logits, rows, range(num_seeds), [0] * num_seeds))


def test_min_p_never_samples_below_the_threshold():
    logits = torch.linspace(3.0, -3.0, V)  # token t has probability ~ exp(-0.12 t)
    p = SamplingParams(temperature=1.0, min_p=0.3)
    probs = logits.softmax(-1)
    allowed = (probs >= 0.3 * probs.max()).nonzero().flatten()
    tokens = draws(logits, p, 3000)
    assert tokens.max() <= allowed.max() and len(tokens.unique()) == len(allowed)


def test_logit_bias_minus_100_never_and_plus_100_always():
    logits = torch.zeros(V)
    logits[7] = 8.0  # the favourite, by far
    never = SamplingParams(temperature=1.0, logit_bias=((7, -100.0),))
    assert 7 not in draws(logits, never, 2000).tolist()
    always = SamplingParams(temperature=1.5, logit_bias=((42, 100.0),))
    assert set(draws(logits, always, 2000).tolist()) == {42}


def test_penalized_distribution_matches_the_oracle_probabilities():
    """Empirical frequencies over many seeds vs HF repetition + the loop's presence/frequency,
    temperature and min_p, within 5 standard errors for every token."""
    small = 8
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -4.0])
    p = SamplingParams(
        temperature=0.8,
        repetition_penalty=1.4,
        presence_penalty=0.4,
        frequency_penalty=0.2,
        min_p=0.02,
    )
    prompt, output = [0, 4], [1, 1, 2]
    counts = TokenCounts(1, small)
    counts.start([0], [p], [prompt], [output])
    past = counts.past([0], [p], [len(output)], [frozenset()])
    want = hf(RepetitionPenaltyLogitsProcessor(1.4), logits, prompt + output)
    want = presence_frequency_oracle(want, output, 0.4, 0.2)
    want = MinPLogitsWarper(0.02)(None, TemperatureLogitsWarper(0.8)(None, want[None]))[0]
    want = want.softmax(-1)
    n = 20000  # one request's draws 0 .. n-1 (seed 0) on the same logits and past
    tokens = torch.tensor([sample(logits[None], [p], [0], [k], past)[0] for k in range(n)])
    freq = torch.bincount(tokens, minlength=small).float() / n
    sigma = (want * (1 - want) / n).sqrt()
    assert torch.all((freq - want).abs() <= 5 * sigma + 1e-4), (freq, want)
    assert freq[7] == 0 and want[7] == 0  # below min_p


def test_seeded_rows_with_penalties_give_the_same_stream_in_any_batch():
    logits, prompts, outputs = random_case(6, num_rows=3)
    p = SamplingParams(temperature=1.0, seed=77, repetition_penalty=1.3, frequency_penalty=0.5)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, seed=3, min_p=0.1)]
    alone_past = history([p], prompts[1:2], outputs[1:2])
    alone = [sample(logits[1:2], [p], [77], [k], alone_past)[0] for k in range(20)]
    params = [others[0], p, others[1]]
    past = history(params, prompts, outputs)
    assert alone == [sample(logits, params, [None, 77, 3], [k, k, k], past)[1] for k in range(20)]


# ---- parameters and their wire form ---------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.01},
        {"presence_penalty": float("nan")},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"repetition_penalty": float("inf")},
        {"min_p": 1.5},
        {"min_p": -0.1},
        {"min_tokens": -1},
        {"min_tokens": 17, "max_new_tokens": 16},
        {"logit_bias": ((5, 101.0),)},
        {"logit_bias": ((-1, 1.0),)},
    ],
)
def test_bad_values_are_refused(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    SamplingParams(logit_bias=((V - 1, 1.0),)).check_vocab(V)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        SamplingParams(logit_bias=((V, 1.0),)).check_vocab(V)


def test_every_field_crosses_the_wire():
    p = SamplingParams(
        temperature=0.5,
        seed=9,
        max_new_tokens=20,
        stop_token_ids=(4, 5),
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        min_p=0.1,
        min_tokens=3,
        logit_bias=((1, 2.0), (30, -100.0)),
    )
    msg = Reserve("r", 1, 3, sampling_to_dict(p), 5.0, prompt_ids=[7, 8, 9])
    back = decode(encode(msg))
    assert back == msg and sampling_from_dict(back.sampling) == p
    for bad in ([[1]], [["1", 2.0]], [[1, "x"]], [1, 2]):
        with pytest.raises(ProtocolError):
            sampling_from_dict({**sampling_to_dict(p), "logit_bias": bad})
