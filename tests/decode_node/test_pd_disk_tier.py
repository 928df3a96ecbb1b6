"""The prefix cache's disk tier through a prefill and a decode node (in-process): pages evicted
from P's small pool are written to the store and read back when their prompt comes again, a
damaged file is refused and its tokens computed, and another prefill node (or this one
restarted) over the same directory starts warm. Every output is the offline generator's.

P's pages and chunks are 4 tokens, so a prefix served from either tier ends on a chunk boundary
and P's rows are the offline generator's bit for bit (as in test_pd_prefix.py)."""

import json

import pytest
import torch
from pd_harness import Pair

from control.sampling_params import SamplingParams
from model.deepseek import DeepseekModel
from runtime.generate import OfflineGenerator

SYSTEM = [3, 44, 18, 250, 9, 71, 130, 5, 66, 301, 12, 40, 77, 8, 19, 23, 31]  # 17 tokens
PROMPT_A = SYSTEM + [5, 6, 7]  # 20 tokens: 4 pages may come from a cache (never the last token)
PROMPT_B = [7, 8, 9, 10] * 5
PAIR = {"p_page_size": 4, "chunk_size": 4, "max_batch_tokens": 4, "p_num_pages": 6}


def greedy(max_new=5):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(model):
    generator = OfflineGenerator(model, page_size=16, chunk_size=4)
    return lambda prompt: generator.generate(list(prompt), greedy()).token_ids


def serve(pair, rid, prompt):
    assert pair.submit(rid, prompt, greedy()).ok
    pair.run_all()
    seen = pair.seen[rid]
    assert not seen.errors, seen.errors
    return seen.output


def test_evicted_pages_come_back_from_disk(model, offline, tmp_path):
    pair = Pair(model, **PAIR, disk_cache_dir=tmp_path)
    cache = pair.prefill.prefix_cache
    try:
        assert serve(pair, "a", PROMPT_A) == offline(PROMPT_A)
        assert serve(pair, "b", PROMPT_B) == offline(PROMPT_B)  # 6 pages: A's tail is evicted
        assert cache.store.num_stored >= 3
        pool_hit = cache.match(PROMPT_A[:16], 0).num_tokens
        assert serve(pair, "a2", PROMPT_A) == offline(PROMPT_A)
        assert cache.num_store_hits == 1 and cache.num_store_hit_tokens == 16 - pool_hit > 0
        assert pair.prefill.heartbeat().num_disk_hit_tokens == 16 - pool_hit
    finally:
        pair.close()


def test_a_damaged_page_is_computed_instead(model, offline, tmp_path):
    pair = Pair(model, **PAIR, disk_cache_dir=tmp_path)
    cache = pair.prefill.prefix_cache
    try:
        serve(pair, "a", PROMPT_A)
        cache.clear()  # every page of A to disk
        for path in cache.store.dir.glob("*.kv"):
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x01
            path.write_bytes(bytes(data))
        assert serve(pair, "a2", PROMPT_A) == offline(PROMPT_A)
        assert cache.store.num_corrupt == 1 and cache.num_store_hit_tokens == 0
    finally:
        pair.close()


def test_another_node_over_the_same_store_starts_warm(model, offline, tmp_path):
    first = Pair(model, **PAIR, disk_cache_dir=tmp_path)
    try:
        serve(first, "a", PROMPT_A)
        first.prefill.prefix_cache.clear()  # evicted, so written to disk
    finally:
        first.close()
    second = Pair(model, **PAIR, disk_cache_dir=tmp_path)  # a restart, or a second node
    try:
        assert serve(second, "a", PROMPT_A) == offline(PROMPT_A)
        cache = second.prefill.prefix_cache
        assert cache.num_hit_tokens == 0 and cache.num_store_hit_tokens == 16
    finally:
        second.close()


def test_a_node_of_another_attention_scheme_keeps_a_store_of_its_own(tiny_dir, tmp_path):
    """The KV rows depend on the attention projections' scheme: int4 prefill nodes of the
    default (int8) and of bf16 attention over one directory write two stores; the default's
    layout names no `attention`, as before the key (its existing store stays its own)."""
    layouts = {}
    for attention in (None, "none"):
        model = DeepseekModel.from_pretrained(
            tiny_dir, torch.bfloat16, progress=False, quant="int4", quant_attention=attention
        )
        pair = Pair(model, **PAIR, disk_cache_dir=tmp_path)
        try:
            store = pair.prefill.prefix_cache.store.dir
            layouts[store] = json.loads((store / "layout.json").read_text())
        finally:
            pair.close()
    default, dense = layouts.values()
    assert len(layouts) == 2 and default["quant"] == dense["quant"] == "int4"
    assert "attention" not in default and dense["attention"] == "none"
