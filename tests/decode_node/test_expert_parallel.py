"""Expert parallelism on the tiny model (float32): two gloo processes on loopback, each holding
half the routed experts, give the same greedy tokens as one process holding them all."""

from __future__ import annotations

import datetime
import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from control.errors import ConfigError
from decode_node.expert_parallel import ExpertParallel, check_shardable, expert_shard
from model.batch import ForwardBatch
from model.deepseek import DeepseekModel
from model.layers import MoE
from native import ops

PROMPTS = [[5, 17, 33, 2, 40], [7, 7, 100, 3], [250, 11, 9, 60, 61, 62, 8], [1, 2]]
NUM_DECODE = 6


def greedy(model: DeepseekModel, prompts: list[list[int]], ep: ExpertParallel | None):
    """Prefill `prompts` in one extend batch, then NUM_DECODE greedy decode steps; a rank with
    no prompts joins each step's exchanges empty. -> token ids per prompt."""
    pool = model.new_kv_pool(num_pages=64, page_size=4)
    tables = [pool.new_table() for _ in prompts]
    for table, prompt in zip(tables, prompts, strict=True):
        pool.reserve(table, len(prompt) + NUM_DECODE + 1)
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(NUM_DECODE + 1):
        if not prompts:
            ep.idle_step()
            continue
        if step == 0:
            fb = ForwardBatch.build(pool, tables, prompts, [0] * len(prompts), is_decode=False)
        else:
            fb = ForwardBatch.build(
                pool,
                tables,
                [[out[-1]] for out in outputs],
                [len(p) + step - 1 for p in prompts],
                is_decode=True,
            )
        for out, token in zip(outputs, model.forward(fb, pool).argmax(-1).tolist(), strict=True):
            out.append(token)
    return outputs


def _rank_main(rank: int, world: int, port: int, model_dir: str, split: list, out_dir: str):
    ops.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        cfg_e = json.load(open(f"{model_dir}/config.json"))["n_routed_experts"]
        shard = expert_shard(cfg_e, rank, world)
        model = DeepseekModel.from_pretrained(model_dir, torch.float32, shard, progress=False)
        ep = ExpertParallel(model, rank, world)
        tokens = greedy(model, [PROMPTS[i] for i in split[rank]], ep)
        moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
        shapes = [list(m.experts.w13.shape) + list(m.experts.w2.shape) for m in moe]
        result = {"tokens": tokens, "shard": [shard.start, shard.stop], "shapes": shapes}
        json.dump(result, open(f"{out_dir}/rank{rank}.json", "w"))
        if rank == 0:  # keep the weights for the shard check in the parent
            torch.save(
                {i: (m.experts.w13, m.experts.w2) for i, m in enumerate(moe)}, f"{out_dir}/rank0.pt"
            )
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(model_dir, split, tmp_path, world=2):
    mp.spawn(
        _rank_main,
        args=(world, _free_port(), str(model_dir), split, str(tmp_path)),
        nprocs=world,
        join=True,
    )
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(world)]


@pytest.fixture(scope="module")
def full_fp32(tiny_dir):
    return DeepseekModel.from_pretrained(tiny_dir, torch.float32, progress=False)


@pytest.fixture(scope="module")
def reference(full_fp32):
    """ranks = 1: all prompts in one batch, every expert local, no communication."""
    return greedy(full_fp32, PROMPTS, None)


@pytest.mark.parametrize(
    "split", [[[0, 2], [1, 3]], [[0, 1, 2, 3], []]], ids=["spread", "rank1-empty"]
)
def test_two_ranks_match_one(tiny_dir, reference, split, tmp_path):
    results = _run_ranks(tiny_dir, split, tmp_path)
    for rank, result in enumerate(results):
        assert result["tokens"] == [reference[i] for i in split[rank]]


def test_three_ranks_with_uneven_shards_match_one(tiny_dir, reference, tmp_path):
    split = [[3], [0, 1], [2]]  # 8 experts over 3 ranks: shards of 2, 3 and 3
    results = _run_ranks(tiny_dir, split, tmp_path, world=3)
    assert [r["shard"] for r in results] == [[0, 2], [2, 5], [5, 8]]
    for rank, result in enumerate(results):
        assert result["tokens"] == [reference[i] for i in split[rank]]


def test_each_rank_holds_only_its_shard(tiny_dir, full_fp32, tmp_path):
    results = _run_ranks(tiny_dir, [[0], [1]], tmp_path)
    num_experts = full_fp32.cfg.n_routed_experts
    assert [r["shard"] for r in results] == [[0, num_experts // 2], [num_experts // 2, num_experts]]
    full_moe = [layer.mlp for layer in full_fp32.layers if isinstance(layer.mlp, MoE)]
    for result in results:
        for shape in result["shapes"]:
            assert shape[0] == shape[3] == num_experts // 2  # w13 [E/2, 2I, D], w2 [E/2, D, I]
    rank0 = torch.load(tmp_path / "rank0.pt")
    for i, moe in enumerate(full_moe):  # rank 0's tensors are exactly the first half
        torch.testing.assert_close(rank0[i][0], moe.experts.w13[: num_experts // 2], rtol=0, atol=0)
        torch.testing.assert_close(rank0[i][1], moe.experts.w2[: num_experts // 2], rtol=0, atol=0)


def test_uneven_shards_and_refusal():
    assert [expert_shard(8, r, 3) for r in range(3)] == [range(0, 2), range(2, 5), range(5, 8)]
    assert [len(expert_shard(7, r, 2)) for r in range(2)] == [3, 4]
    with pytest.raises(ConfigError, match="exceeds the model's 2 routed experts"):
        check_shardable(2, 3)
