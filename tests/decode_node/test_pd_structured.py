"""Structured output through the real prefill and decode loops (in-process, float32 tiny model):
P masks the first token, D the rest (its masks computed on a helper thread during the forward);
each request's output equals OfflineGenerator's with the same params, token for token, in
batches mixing grammars, free text and other sampling; every output validates; and a spec that
does not compile is refused by either node with the reason."""

import json

import pytest
from pd_harness import Pair
from structured_cases import CASES, JSON_OBJECT, MAX_NEW, check_output
from test_pd_sampling import PROMPTS as SAMPLING_PROMPTS

from control.protocol import Prefill, RequestError, sampling_to_dict
from control.sampling_params import SamplingParams
from control.tokenizer import Tokenizer
from runtime.grammar import MIN_OVERLAP_ROWS

PROMPTS = [*SAMPLING_PROMPTS, [2, 60, 61, 62]]


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer(tiny_dir)


def mixed_params() -> list[SamplingParams]:
    """Every case, greedy and seeded (with penalties, top-k, logit_bias), plus free text."""
    out = [SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)]
    for i, structured in enumerate(CASES.values()):
        out.append(SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, structured=structured))
        out.append(
            SamplingParams(
                temperature=1.5,
                seed=20 + i,
                top_k=50,
                presence_penalty=0.5,
                repetition_penalty=1.2,
                logit_bias=((6, 2.0),),
                ignore_eos=True,  # no effect: a structured request always stops at EOS
                max_new_tokens=MAX_NEW,
                structured=structured,
            )
        )
    return out


@pytest.mark.parametrize("max_batch", [4, 12])  # slots reused; steps whose masks use the thread
def test_constrained_outputs_match_offline_and_validate(model32, offline32, tok, max_batch):
    pair = Pair(model32, max_batch=max_batch, d_num_pages=512)
    threaded = []
    start = pair.decode.grammars.start_masks
    pair.decode.grammars.start_masks = lambda ms: (
        threaded.append(sum(m is not None for m in ms) >= MIN_OVERLAP_ROWS),
        start(ms),
    )[1]
    params = mixed_params()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        assert pair.submit(f"r{i}", prompt, p).ok
    pair.run_all()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        seen, ref = pair.seen[f"r{i}"], offline32(prompt, p)
        assert not seen.errors and seen.output == ref.token_ids, f"r{i}"
        assert seen.finish_reason == ref.finish_reason
        if p.structured is not None:
            assert seen.finish_reason == "stop", f"r{i} did not complete"
            check_output(*p.structured, tok.decode(seen.output))
    assert any(threaded) == (max_batch >= MIN_OVERLAP_ROWS) and not all(threaded)
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    pair.close()


def test_json_object_matches_offline_complete_or_not(model32, offline32, tok):
    """An unbounded grammar on random weights: the tokens still equal the offline run's, and
    every one of them was accepted by the grammar (the offline run checks each)."""
    pair = Pair(model32)
    p = SamplingParams(temperature=0.0, max_new_tokens=24, structured=JSON_OBJECT)
    for i, prompt in enumerate(PROMPTS[:3]):
        assert pair.submit(f"o{i}", prompt, p).ok
    pair.run_all()
    for i, prompt in enumerate(PROMPTS[:3]):
        seen = pair.seen[f"o{i}"]
        assert not seen.errors and seen.output == offline32(prompt, p).token_ids
        assert tok.decode(seen.output).startswith("{")
    pair.close()


BAD = ("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/no"}}}))


def test_the_decode_node_refuses_a_spec_that_does_not_compile(model32):
    pair = Pair(model32)
    reply, _ = pair.reserve("bad", 4, SamplingParams(structured=BAD))
    assert not reply.ok and "structured output: invalid json_schema" in reply.reason
    assert "/no" in reply.reason and pair.decode_pages_used == 0
    pair.close()


def test_the_prefill_node_refuses_a_spec_that_does_not_compile(model32):
    pair = Pair(model32)
    pair.seen.setdefault("bad", None)
    sampling = sampling_to_dict(SamplingParams(structured=("regex", "[a-")))
    pair.p_in.put(Prefill("bad", 1, [1, 2, 3], sampling, pair.receiver.endpoint, 5.0))
    pair.prefill.step()
    (error,) = pair.p_out.take(RequestError)
    assert error.request_id == "bad" and "structured output: invalid regex" in error.message
    assert pair.prefill_pages_used == 0
    pair.close()


def test_a_resumed_attempt_replays_the_streamed_output(model32, offline32, tok):
    """A restarted attempt (prompt + the output streamed so far, structured_resume = its
    length) goes on inside the grammar: its tokens are the rest of the uninterrupted run's."""
    structured = CASES["object"]
    whole = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, structured=structured)
    prompt = PROMPTS[0]
    ref = offline32(prompt, whole).token_ids
    assert ref[-1] == 1 and len(ref) > 12  # EOS; long enough to cut in the middle
    pair = Pair(model32, d_num_pages=256)
    for k in (1, 7, 12):
        resumed = SamplingParams(
            temperature=0.0,
            max_new_tokens=MAX_NEW - k,
            structured=structured,
            structured_resume=k,
        )
        assert pair.submit(f"k{k}", prompt + ref[:k], resumed).ok
    pair.run_all()
    for k in (1, 7, 12):
        seen = pair.seen[f"k{k}"]
        assert not seen.errors and seen.output == ref[k:], k
        check_output(*structured, tok.decode(ref[:k] + seen.output))
    # a resume whose output the grammar refuses is refused at the reservation
    bad = SamplingParams(structured=structured, structured_resume=2)
    reply = pair.submit("bad", [5, 6, 7, 8], bad)
    assert not reply.ok and "resume from breaks the grammar" in reply.reason
    pair.close()


def test_n_sequences_each_walk_the_grammar_on_their_own(model32, offline32, tok):
    """n > 1: P samples every sequence's first token under the one first mask, D forks the
    grammar with the KV; sequence i equals the single request sampled by for_sequence(i)."""
    n = 4
    for name in ("regex", "object"):
        pair = Pair(model32, max_batch=2, d_num_pages=256)  # forks wait for a slot
        params = SamplingParams(
            temperature=1.5, seed=3, top_k=50, max_new_tokens=MAX_NEW, n=n, structured=CASES[name]
        )
        assert pair.submit("s", PROMPTS[0], params).ok
        pair.run_all()
        ids = ["s", *(f"s/{i}" for i in range(1, n))]
        outputs = [pair.seen[rid].output for rid in ids]
        assert outputs == [
            offline32(PROMPTS[0], params.for_sequence(i)).token_ids for i in range(n)
        ]
        for out, rid in zip(outputs, ids, strict=True):
            assert pair.seen[rid].finish_reason == "stop" and not pair.seen[rid].errors
            check_output(*CASES[name], tok.decode(out))
        assert len({tuple(o) for o in outputs}) > 1, name  # the sequences differ
        assert pair.decode_pages_used == 0
        pair.close()
