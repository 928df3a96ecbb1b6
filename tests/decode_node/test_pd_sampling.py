"""Sampling with penalties, min_p, min_tokens and logit_bias through the real prefill and decode
loops (in-process, float32 tiny model): each request's output equals OfflineGenerator's token
for token, in batches where every request has other params and slots are reused; and the
nodes refuse sampling they cannot honour."""

from pd_harness import Pair

from control.protocol import RequestError
from control.sampling_params import SamplingParams

PROMPTS = [
    [3, 44, 18, 250, 9, 71, 130, 5, 66, 301, 12, 40, 77, 8],
    [5, 6, 7, 8, 9] * 5,
    [100, 200, 300],
    list(range(10, 31)),
    [7, 7, 7, 7],
    [400, 12, 12, 90, 91],
]


def mixed_params() -> list[SamplingParams]:
    """One request per prompt, each sampling differently (and one without any of it)."""
    common = {"max_new_tokens": 10, "ignore_eos": True}
    return [
        SamplingParams(temperature=0.0, repetition_penalty=1.8, **common),
        SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7, **common),
        SamplingParams(
            temperature=0.9,
            seed=11,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            min_p=0.05,
            **common,
        ),
        SamplingParams(temperature=0.0, **common),
        SamplingParams(temperature=0.8, seed=5, min_p=0.2, top_k=30, logit_bias=((17, 3.0),)),
        SamplingParams(temperature=0.0, frequency_penalty=-1.0, logit_bias=((2, -100.0),)),
    ]


def test_penalties_in_mixed_batches_match_offline(model32, offline32):
    pair = Pair(model32, max_batch=3)  # six requests: slots are given back and reused
    batches = []
    original = pair.decode._start_step
    pair.decode._start_step = lambda batch: (batches.append(len(batch)), original(batch))[1]
    params = mixed_params()
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        assert pair.submit(f"r{i}", prompt, p).ok
    pair.run_all()
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        seen = pair.seen[f"r{i}"]
        assert not seen.errors and seen.output == offline32(prompt, p).token_ids, f"r{i}"
    assert max(batches) == 3
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    pair.close()


def test_the_penalties_change_what_is_generated(offline32):
    """Else the test above would prove little: each penalty changes the greedy output."""
    plain = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    greedy = offline32(PROMPTS[4], plain).token_ids  # repeats itself: 0, 368, 0, 368, ...
    for change in (
        {"repetition_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"logit_bias": ((greedy[0], -100.0),)},
    ):
        p = SamplingParams(**{**plain.__dict__, **change})
        assert offline32(PROMPTS[4], p).token_ids != greedy, change


def test_min_tokens_holds_back_the_stop_token_where_offline_does(model32, offline32):
    plain = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    stop = offline32(PROMPTS[0], plain).token_ids[0]  # stops at once without min_tokens
    p = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,), min_tokens=4)
    want = offline32(PROMPTS[0], p).token_ids
    assert len(want) >= 5 and stop not in want[:4]
    pair = Pair(model32)
    assert pair.submit("m", PROMPTS[0], p).ok
    pair.run_all()
    assert pair.seen["m"].output == want
    pair.close()


def test_sampling_the_nodes_cannot_honour_is_refused(model32):
    pair = Pair(model32)
    rep = SamplingParams(repetition_penalty=1.2)
    reply, _ = pair.reserve("no-prompt", 4, rep)  # the prompt's ids are not sent
    assert not reply.ok and "prompt ids" in reply.reason
    reply, _ = pair.reserve("short", 4, rep, prompt=[1, 2])
    assert not reply.ok
    vocab = model32.cfg.vocab_size
    bias = SamplingParams(logit_bias=((vocab, 1.0),))
    reply, _ = pair.reserve("bias", 4, bias)
    assert not reply.ok and "outside the vocabulary" in reply.reason
    pair.prefill_only("bias-p", 7, [1, 2, 3], bias)
    pair.settle(2)
    (error,) = pair.seen["bias-p"].errors
    assert isinstance(error, RequestError) and "outside the vocabulary" in error.message
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    pair.close()
