"""The prefill and decode nodes with MTP speculative decoding (mtp = true), in-process: served
output equals plain offline decoding (greedy) and the offline speculative generator (seeded
sampling), requests that cannot speculate decode as before beside those that do, and pages are
freed on every path (abort with drafts in flight included)."""

import dataclasses

import pytest
import torch
from pd_harness import Pair

import decode_node.speculative_step as speculative_step
from control.sampling_params import SamplingParams
from model.deepseek import DeepseekModel
from runtime.generate import OfflineGenerator
from runtime.speculative_generate import SpeculativeGenerator
from tinymodel.make import make_tiny_model

PROMPTS = [
    [3, 44, 18, 250, 9, 71, 130, 5, 66, 301, 12, 40, 77, 8],
    [5, 6, 7, 8, 9] * 5,
    [100, 200, 300],
    list(range(10, 31)),
]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """float32 (served and offline agree token for token), with a random MTP layer."""
    path = make_tiny_model(
        tmp_path_factory.mktemp("mtp"), seed=5, overrides={"num_nextn_predict_layers": 1}
    )
    return DeepseekModel.from_pretrained(path, dtype=torch.float32, progress=False, mtp=True)


@pytest.fixture(scope="module")
def plain_output(mtp_model):
    generator = OfflineGenerator(mtp_model, page_size=16)
    return lambda prompt, params: generator.generate(prompt, params).token_ids


def greedy(max_new=12, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True, **kw)


def _serve(pair, requests):
    for rid, (prompt, params) in requests.items():
        assert pair.submit(rid, prompt, params).ok
    pair.run_all()
    for rid in requests:
        assert not pair.seen[rid].errors, pair.seen[rid].errors
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    return {rid: pair.seen[rid].output for rid in requests}


@pytest.mark.parametrize("mtp_tokens", [1, 3])
def test_greedy_with_mtp_equals_plain_decoding(mtp_model, plain_output, mtp_tokens):
    """Four concurrent speculating requests plus two that cannot speculate (logprobs, a
    frequency penalty) in the same batches: every output is plain decoding's."""
    requests = {f"r{i}": (p, greedy(10 + i)) for i, p in enumerate(PROMPTS)}
    requests["logprobs"] = (PROMPTS[0], greedy(8, logprobs=2))
    requests["penalty"] = (PROMPTS[1], greedy(8, frequency_penalty=0.5))
    pair = Pair(mtp_model, mtp_tokens=mtp_tokens, max_batch=6)
    served = _serve(pair, requests)
    for rid, (prompt, params) in requests.items():
        assert served[rid] == plain_output(prompt, params), rid
    assert len(pair.seen["logprobs"].logprobs) == 7
    stats = pair.decode.speculative.stats
    assert stats.drafted > 0 and stats.request_steps > 0
    pair.close()


def _true_drafts(monkeypatch, continuations):
    """The decode node's drafts become the plain output's next tokens (the MTP pass still runs
    and writes its rows): a request's drafts are all accepted."""
    real = speculative_step.draft

    def fake(model, pool, tables, tokens, positions, hidden, num_drafts, *block_table):
        real(model, pool, tables, tokens, positions, hidden, num_drafts, *block_table)
        out = []
        for table, toks, pos, n in zip(tables, tokens, positions, num_drafts, strict=True):
            full = continuations[id(table)]
            out.append(full[pos + len(toks) + 1 : pos + len(toks) + 1 + n])
        return out

    monkeypatch.setattr(speculative_step, "draft", fake)


def test_accepted_drafts_emit_several_tokens_a_step(mtp_model, plain_output, monkeypatch):
    """With drafts that are right, a step emits up to mtp_tokens + 1 tokens (rows crossing
    D's 5-token pages); outputs stay plain decoding's, fewer steps run, and the heartbeat
    carries the figures /metrics exports."""
    pair = Pair(mtp_model, mtp_tokens=3)
    requests = {"a": (PROMPTS[0], greedy(20)), "b": (PROMPTS[3], greedy(17))}
    expected = {rid: plain_output(p, s) for rid, (p, s) in requests.items()}
    continuations = {}
    original = pair.decode.scheduler.kv_ready

    def kv_ready(request_id, *args, **kwargs):  # map the request's page table to its truth
        request = pair.decode.scheduler.get(request_id)
        prompt = requests[request_id][0]
        continuations[id(request.table)] = prompt + expected[request_id]
        return original(request_id, *args, **kwargs)

    pair.decode.scheduler.kv_ready = kv_ready
    _true_drafts(monkeypatch, continuations)
    steps = []
    run = pair.decode.speculative.run
    pair.decode.speculative.run = lambda batch: (steps.append(len(batch)), run(batch))[1]
    served = _serve(pair, requests)
    assert served == expected
    stats = pair.decode.speculative.stats
    # Every draft but P's first (the random MTP layer's) is right.
    assert stats.accepted >= stats.drafted - len(requests)
    assert stats.tokens_per_step > 3.0
    assert len(steps) < 19 / 2
    pair.settle(1)
    hb = [h for h in pair.heartbeats if h.role == "decode"][-1]
    assert (hb.mtp_drafted, hb.mtp_accepted) == (stats.drafted, stats.accepted)
    assert hb.mtp_emitted == stats.emitted and hb.mtp_request_steps == stats.request_steps
    pair.close()


def test_abort_with_drafts_in_flight_frees_every_page(mtp_model, plain_output, monkeypatch):
    pair = Pair(mtp_model, mtp_tokens=4, d_page_size=2)
    prompt, params = PROMPTS[1], greedy(40)
    truth = prompt + plain_output(prompt, params)
    continuations = {}
    original = pair.decode.scheduler.kv_ready

    def kv_ready(request_id, *args, **kwargs):
        continuations[id(pair.decode.scheduler.get(request_id).table)] = truth
        return original(request_id, *args, **kwargs)

    pair.decode.scheduler.kv_ready = kv_ready
    _true_drafts(monkeypatch, continuations)
    assert pair.submit("a", prompt, params).ok
    pair.run_until(lambda: len(pair.seen["a"].token_ids) >= 6, "some speculated tokens")
    request = pair.decode.scheduler.get("a")
    assert request.drafts  # drafts pending, their pages reserved ahead
    assert request.table.capacity > request.next_position + 1
    pair.abort("a")
    pair.settle(2)
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    assert pair.seen["a"].finish_reason is None and not pair.seen["a"].errors
    pair.close()


def test_seeded_sampling_with_mtp_equals_the_offline_speculative_generator(mtp_model):
    """The served stream and the offline twin consume each request's random stream alike
    (acceptance draws, corrections, bonus tokens)."""
    spec = SpeculativeGenerator(mtp_model, 2, page_size=16, chunk_size=4)
    base = SamplingParams(temperature=1.5, top_k=4, max_new_tokens=12, ignore_eos=True)
    requests = {
        f"s{seed}": (PROMPTS[seed % len(PROMPTS)], dataclasses.replace(base, seed=seed))
        for seed in range(4)
    }
    pair = Pair(mtp_model, mtp_tokens=2, max_batch=4)
    served = _serve(pair, requests)
    for rid, (prompt, params) in requests.items():
        assert served[rid] == spec.generate(prompt, params).token_ids, rid
    assert pair.decode.speculative.stats.accepted > 0
    pair.close()


def test_a_node_with_mtp_needs_the_mtp_layer(tiny_dir):
    from control.errors import ConfigError

    model = DeepseekModel.from_pretrained(tiny_dir, dtype=torch.float32, progress=False)
    with pytest.raises(ConfigError, match="MTP layer"):
        Pair(model, mtp_tokens=1)


def test_drafts_never_take_the_pages_others_need(mtp_model, plain_output, monkeypatch):
    """On-demand KV with no headroom and a pool of exactly the requests' worst case: draft rows
    take their pages as they go (never past max_tokens, and only while a page per running
    request stays free), so no request is preempted and the outputs stay plain decoding's."""
    requests = {"a": (PROMPTS[0], greedy(12)), "b": (PROMPTS[2], greedy(12))}
    expected = {rid: plain_output(p, s) for rid, (p, s) in requests.items()}
    page_size = 5
    pages = sum(-(-(len(p) + s.max_new_tokens) // page_size) for p, s in requests.values())
    pair = Pair(
        mtp_model,
        mtp_tokens=4,
        d_page_size=page_size,
        d_num_pages=pages,
        kv_reservation="on_demand",
        kv_headroom_tokens=0,
    )
    continuations = {}
    original = pair.decode.scheduler.kv_ready

    def kv_ready(request_id, *args, **kwargs):
        prompt = requests[request_id][0]
        table = pair.decode.scheduler.get(request_id).table
        continuations[id(table)] = prompt + expected[request_id]
        return original(request_id, *args, **kwargs)

    pair.decode.scheduler.kv_ready = kv_ready
    _true_drafts(monkeypatch, continuations)
    assert _serve(pair, requests) == expected
    assert pair.decode.scheduler.num_preempted == 0
    assert pair.decode.speculative.stats.accepted > 0
    pair.close()
