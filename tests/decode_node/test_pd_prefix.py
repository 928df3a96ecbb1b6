"""The prefix cache through a prefill and a decode node (in-process): a prompt served from P's
cache decodes the same greedy tokens as offline and as its cold twin (D, which keeps no cache,
got every row), concurrent prompts sharing a prefix, and the abort of one of them.

P's pages and chunks are both 4 tokens and a forward computes one chunk, so a cached prefix
(whole pages) ends on a chunk boundary and every chunk is the offline generator's (chunk 4):
bf16 rows are then bit-identical, cold or warm. (With other boundaries bf16 sums in another
order, which can flip a near-tied greedy choice: tests/runtime/test_generate.py shows it for chunk sizes alone.)"""

import pytest
from pd_harness import Pair

from control.sampling_params import SamplingParams
from runtime.generate import OfflineGenerator

SYSTEM = [3, 44, 18, 250, 9, 71, 130, 5, 66, 301, 12, 40, 77, 8, 19, 23, 31]  # 17 tokens
PAIR = {"p_page_size": 4, "chunk_size": 4, "max_batch_tokens": 4}
QUESTIONS = [[5, 6, 7], [100, 200, 300, 400, 9], [42]]


def greedy(max_new=6):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)


@pytest.fixture
def pair(model):
    pair = Pair(model, **PAIR)
    yield pair
    pair.close()


@pytest.fixture(scope="module")
def offline(model):
    """offline(prompt, params) -> the offline generator's tokens, in P's chunks."""
    generator = OfflineGenerator(model, page_size=16, chunk_size=4)
    return lambda prompt, params: generator.generate(list(prompt), params).token_ids


def test_a_warm_prompt_decodes_what_a_cold_one_does(pair, offline):
    prompt = SYSTEM + QUESTIONS[0]
    for rid in ("cold", "warm"):
        assert pair.submit(rid, prompt, greedy()).ok
        pair.run_all()
    cache = pair.prefill.prefix_cache
    assert cache.num_hits == 1 and cache.num_hit_tokens == 16  # 19 may match: 4 pages of 4
    expected = offline(prompt, greedy())
    for rid in ("cold", "warm"):
        seen = pair.seen[rid]
        assert not seen.errors and seen.output == expected, rid
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0


def test_concurrent_prompts_sharing_a_prefix(pair, offline):
    assert pair.submit("seed", SYSTEM + [1], greedy(2)).ok
    pair.run_all()
    for i, question in enumerate(QUESTIONS):
        assert pair.submit(f"q{i}", SYSTEM + question, greedy()).ok
    pair.run_all()
    for i, question in enumerate(QUESTIONS):
        assert pair.seen[f"q{i}"].output == offline(SYSTEM + question, greedy()), f"q{i}"
    assert pair.prefill.prefix_cache.num_hits == 3
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    pair.prefill.prefix_cache.clear()
    assert pair.prefill.pool.allocator.num_used == 0  # baseline: no lock left behind


def test_abort_of_a_warm_prompt_leaves_the_shared_prefix_to_the_others(model, offline):
    pair = Pair(model, **{**PAIR, "max_batch_tokens": 8})  # both warm prompts in each forward
    prompt = SYSTEM + QUESTIONS[1]  # 22 tokens: chunks [16, 20) and [20, 22) for both
    assert pair.submit("seed", SYSTEM + [1], greedy(2)).ok
    pair.run_all()
    assert pair.submit("gone", prompt, greedy()).ok
    assert pair.submit("stays", prompt, greedy()).ok
    pair.prefill.step()  # both started on the cached prefix and computed their first chunk
    gone, stays = (pair.prefill.scheduler.get(rid) for rid in ("gone", "stays"))
    assert gone.num_cached == stays.num_cached == 16
    shared = gone.table.pages[:4]
    assert stays.table.pages[:4] == shared == pair.prefill.prefix_cache.match(SYSTEM, 0).pages
    pair.abort("gone")
    pair.step()
    assert pair.prefill.scheduler.get("gone") is None
    assert pair.prefill.prefix_cache.match(SYSTEM, 0).pages == shared  # still cached
    pair.run_until(lambda: pair.seen["stays"].is_over)
    assert pair.seen["stays"].output == offline(prompt, greedy())
    assert pair.seen["gone"].finish_reason is None
    pair.settle(2)
    assert pair.decode_pages_used == 0 and pair.prefill_pages_used == 0
    pair.prefill.prefix_cache.clear()
    assert pair.prefill.pool.allocator.num_used == 0
    pair.close()


def test_without_the_cache_outputs_are_the_same(model, offline):
    pair = Pair(model, **PAIR, prefix_cache=False)
    prompt = SYSTEM + QUESTIONS[0]
    for rid in ("a", "b"):
        assert pair.submit(rid, prompt, greedy()).ok
        pair.run_all()
        assert pair.seen[rid].output == offline(prompt, greedy())
    assert pair.prefill.prefix_cache is None and pair.prefill.pool.allocator.num_used == 0
    pair.close()
