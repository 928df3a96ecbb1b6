"""Tensor parallelism (`model.tensor_parallel`) on the tiny model, float32: two gloo
processes on loopback, each holding half the heads, half of every MLP's columns and half the
routed experts, give the logits and KV rows of one process holding everything, through
chunked prefill with a cached prefix (the extend path) and a decode step; both ranks agree
exactly, with the all-reduce over gloo and over the shared-memory segment. The shared-memory
all-reduce alone: the sum in rank order on every rank, tensors longer than a slot in pieces,
its segment unlinked once mapped, and a peer that never comes an error after the timeout. A
model whose heads do not split evenly is refused with a clear error."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from control.errors import ConfigError
from control.model_config import ModelConfig
from deploy.local_cluster import free_port
from model.batch import ForwardBatch
from model.deepseek import DeepseekModel
from model.sequence_parallel import install_sequence_parallel
from model.sharding import check_tensor_parallel
from model.tensor_parallel import (
    gloo_all_reduce,
    install_tensor_parallel,
    shm_all_reduce,
    traffic_per_layer,
)
from native import ops
from tinymodel.builder import V2_LITE_OVERRIDES
from tinymodel.make import make_tiny_model

PROMPTS = [[5, 17, 33, 2, 40, 9, 81, 12, 4], [7, 7, 100, 3, 250, 11, 9, 60]]  # chunk 2: 9 tokens
CHUNK = 4  # the first chunk of each prompt, then the rest over it as a cached prefix


def run(model: DeepseekModel, decode: bool = True) -> dict[str, torch.Tensor]:
    """Chunk 1 of both prompts, chunk 2 over it (prefix), one decode step (unless not
    `decode`): every forward's logits, and the KV rows the pool holds at the end."""
    pool = model.new_kv_pool(num_pages=16, page_size=4)
    tables = [pool.new_table() for _ in PROMPTS]
    for table, prompt in zip(tables, PROMPTS, strict=True):
        pool.reserve(table, len(prompt) + 1)
    first = ForwardBatch.build(pool, tables, [p[:CHUNK] for p in PROMPTS], [0, 0], is_decode=False)
    rest = ForwardBatch.build(
        pool, tables, [p[CHUNK:] for p in PROMPTS], [CHUNK, CHUNK], is_decode=False
    )
    out = {"chunk1": model.forward(first, pool), "chunk2": model.forward(rest, pool)}
    if decode:
        next_tokens = [[int(t)] for t in out["chunk2"].argmax(-1)]
        lens = [len(p) for p in PROMPTS]
        step = ForwardBatch.build(pool, tables, next_tokens, lens, is_decode=True)
        out["decode"] = model.forward(step, pool)
    layers, extra = model.num_kv_layers, 1 if decode else 0
    out["kv"] = torch.cat(
        [
            pool.read_rows(t, 0, layers, 0, len(p) + extra)
            for t, p in zip(tables, PROMPTS, strict=True)
        ],
        dim=1,
    )
    return out


def _join(rank, world, port):
    ops.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )


def _rank_main(rank, world, port, model_dir, out_dir, comm, scheme="tp"):
    _join(rank, world, port)
    try:
        model = DeepseekModel.from_pretrained(
            model_dir,
            torch.float32,
            progress=False,
            tensor_parallel=(rank, world),
            parallel=scheme,
        )
        reduce = gloo_all_reduce() if comm == "gloo" else shm_all_reduce(rank, world)
        if scheme == "tp":
            install_tensor_parallel(model, reduce)
        else:
            install_sequence_parallel(model, reduce)
        held = {"heads": model.layers[0].attn.num_heads, "experts": list(model.expert_range)}
        torch.save({**run(model, decode=scheme == "tp"), **held}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=["v3", "v2-lite"])
def model_dir(request, tmp_path_factory):
    """The tiny model with q_lora (V3-like) and without (V2-Lite: q_proj split by heads)."""
    overrides = V2_LITE_OVERRIDES if request.param == "v2-lite" else None
    return make_tiny_model(tmp_path_factory.mktemp("tp"), seed=5, overrides=overrides)


@pytest.mark.parametrize("comm", ["gloo", "shm"])
def test_two_tensor_parallel_ranks_match_one(model_dir, tmp_path, comm):
    reference = run(DeepseekModel.from_pretrained(model_dir, torch.float32, progress=False))
    mp.spawn(
        _rank_main, args=(2, free_port(), str(model_dir), str(tmp_path), comm), nprocs=2, join=True
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    cfg = ModelConfig.from_model_dir(model_dir)
    assert [r["heads"] for r in ranks] == [cfg.num_attention_heads // 2] * 2
    assert [r["experts"] for r in ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # (Were any split tensor held whole, the all-reduce would count it twice: no match below.)
    for key in ("chunk1", "chunk2", "decode", "kv"):
        assert torch.equal(ranks[0][key], ranks[1][key]), key  # one all-reduced stream
        # fp32, summed in another order: a few ulps of the logits' scale.
        torch.testing.assert_close(ranks[0][key], reference[key], atol=1e-4, rtol=1e-4)
    for key in ("chunk1", "chunk2", "decode"):
        assert torch.equal(ranks[0][key].argmax(-1), reference[key].argmax(-1)), key


@pytest.mark.parametrize("comm", ["gloo", "shm"])
def test_two_sequence_split_ranks_match_one(model_dir, tmp_path, comm):
    """ "tp_sp": each rank holds half the heads and every expert; its forward all-gathers the
    down-projections and all-to-alls the attention output (chunk 2 has 9 tokens: a padded
    piece). The logits and KV rows equal one rank's holding everything."""
    reference = run(
        DeepseekModel.from_pretrained(model_dir, torch.float32, progress=False), decode=False
    )
    mp.spawn(
        _rank_main,
        args=(2, free_port(), str(model_dir), str(tmp_path), comm, "tp_sp"),
        nprocs=2,
        join=True,
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    cfg = ModelConfig.from_model_dir(model_dir)
    assert [r["heads"] for r in ranks] == [cfg.num_attention_heads // 2] * 2
    assert [r["experts"] for r in ranks] == [list(range(8))] * 2
    for key in ("chunk1", "chunk2", "kv"):
        assert torch.equal(ranks[0][key], ranks[1][key]), key
        # fp32; the heads' work is the same sums as one rank's, the MLPs run on fewer rows.
        torch.testing.assert_close(ranks[0][key], reference[key], atol=1e-4, rtol=1e-4)
    for key in ("chunk1", "chunk2"):
        assert torch.equal(ranks[0][key].argmax(-1), reference[key].argmax(-1)), key


def test_a_split_that_is_not_even_is_refused(model_dir):
    cfg = ModelConfig.from_model_dir(model_dir)  # 4 heads, MLP 128, shared experts 32
    check_tensor_parallel(cfg, 4)  # 4 ranks: one head each
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) divisible by 3"):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(ConfigError, match="routed experts"):
        check_tensor_parallel(cfg, 16)  # more ranks than the 8 experts
    with pytest.raises(ConfigError, match="divisible by 3"):
        DeepseekModel.from_pretrained(
            model_dir, torch.float32, progress=False, tensor_parallel=(0, 3)
        )
    # "tp_sp" splits the heads only: 4 ranks (one head each) go, 3 do not; experts stay whole,
    # so more ranks than experts is no limit of its own.
    check_tensor_parallel(cfg, 4, "tp_sp")
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) divisible by 3"):
        check_tensor_parallel(cfg, 3, "tp_sp")
    with pytest.raises(ConfigError, match="divisible by 3"):
        DeepseekModel.from_pretrained(
            model_dir, torch.float32, progress=False, tensor_parallel=(0, 3), parallel="tp_sp"
        )


SIZES = [1, 1000, 2 * 64 + 5]  # the last one longer than the slots (64 floats): in pieces


def _partial(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + n))


def _shm_main(rank, world, port, out_dir):
    _join(rank, world, port)
    try:
        reduce = shm_all_reduce(rank, world, capacity=64, timeout_s=30.0)
        leftovers = sorted(p.name for p in Path("/dev/shm").glob("duet-tp-*"))
        sums = {n: reduce(_partial(rank, n)) for n in SIZES}
        sums["bf16"] = reduce(_partial(rank, 300).bfloat16())
        torch.save({"sums": sums, "leftovers": leftovers}, f"{out_dir}/shm{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_the_shared_memory_all_reduce_sums_in_rank_order_on_every_rank(tmp_path, world):
    before = set(Path("/dev/shm").glob("duet-tp-*"))
    mp.spawn(_shm_main, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"shm{r}.pt") for r in range(world)]
    for n in SIZES:
        want = _partial(0, n)
        for r in range(1, world):
            want = want + _partial(r, n)  # fp32, rank order
        for result in results:
            assert torch.equal(result["sums"][n], want), n
    bf16 = sum(_partial(r, 300).bfloat16().float() for r in range(world)).bfloat16()
    for result in results:
        assert result["sums"]["bf16"].dtype == torch.bfloat16
        assert torch.equal(result["sums"]["bf16"], bf16)
    assert set(Path("/dev/shm").glob("duet-tp-*")) == before  # unlinked once mapped


def test_a_peer_that_never_comes_is_an_error_after_the_timeout(tmp_path):
    from native import _C

    path = str(tmp_path / "segment")
    lonely = _C.ShmAllReduce(path, 0, 2, 16, True, 0.3)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 waited 0\.3.* s for its peers"):
        lonely.all_reduce(torch.ones(4).data_ptr(), 4)
    assert 0.3 <= time.monotonic() - started < 10.0


def test_an_abort_ends_a_peers_wait_at_once_and_every_later_one(tmp_path):
    """Rank 1 waits in an all-reduce for a rank 0 that never comes (a minute's timeout);
    rank 0's abort (its watchdog saw a rank die) ends that wait with an error, and the next."""
    import threading

    from native import _C

    path = str(tmp_path / "segment")
    ranks = [_C.ShmAllReduce(path, r, 2, 16, r == 0, 60.0) for r in range(2)]
    errors = []

    def wait():
        try:
            ranks[1].all_reduce(torch.ones(4).data_ptr(), 4)
        except RuntimeError as exc:
            errors.append(str(exc))

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(0.5)  # most likely asleep on the futex by now; either way it must end
    assert waiter.is_alive()  # nothing else can end its wait for a minute
    ranks[0].abort()
    waiter.join(30)
    assert not waiter.is_alive()
    assert errors == ["shm all-reduce: rank 1: the group was aborted (a peer rank died)"]
    with pytest.raises(RuntimeError, match="aborted"):
        ranks[1].barrier()


def test_the_shared_memory_all_gather_and_all_to_all_move_pieces_longer_than_a_slot(tmp_path):
    """Two ranks (threads: the calls release the GIL) on a segment of 16-float slots: an
    all-gather of 50 floats a rank and an all-to-all of 2 x 30 floats go through in pieces,
    each rank getting what GlooComm would give it."""
    import threading

    from model.tensor_parallel import ShmComm
    from native import _C

    path = str(tmp_path / "segment")
    comms = [ShmComm(_C.ShmAllReduce(path, r, 2, 16, r == 0, 60.0), 2) for r in range(2)]
    parts = [torch.arange(50, dtype=torch.float32) + 1000 * r for r in range(2)]
    pieces = [torch.arange(60, dtype=torch.float32).view(2, 30) + 1000 * r for r in range(2)]
    out = [None, None]

    def rank_main(r):
        out[r] = (comms[r].all_gather(parts[r]), comms[r].all_to_all(pieces[r]))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in range(2):
        gathered, exchanged = out[r]
        assert torch.equal(gathered, torch.stack(parts))
        assert torch.equal(exchanged, torch.stack([pieces[0][r], pieces[1][r]]))


def test_the_dry_run_counts_each_schemes_bytes_by_hand(model_dir):
    """8 tokens over 2 ranks on the tiny shapes (D 64; kv_lora 32, rope 8; 4 heads of v 16), by
    hand: "tp" all-reduces [8, 64] fp32 twice, each sending half of it twice (2 x 2 x 1024 B);
    the sequence-split schemes all-gather the down-projections' [8, W] bf16 (W = q_lora 48 + 40
    = 88; without q_lora, x itself: 64 + 40 = 104; each rank sends its 4 rows: 704 or 832 B),
    then reduce-scatter [8, 64] fp32 (1024 B) or all-to-all the [8, 32] bf16 its two heads
    computed (the other rank's 4 tokens: 256 B)."""
    cfg = ModelConfig.from_model_dir(model_dir)
    gathered = 704.0 if cfg.q_lora_rank == 48 else 832.0
    assert cfg.q_lora_rank in (48, None)
    assert traffic_per_layer(cfg, tokens=8, world=2) == {
        "tp": 4096.0,
        "tp_sp_reduce_scatter": gathered + 1024,
        "tp_sp": gathered + 256,
    }


def _setup_fails_main(rank, world, port, out_dir):
    """Rank 1 takes the segment's name but never maps it: rank 0's setup times out."""
    _join(rank, world, port)
    try:
        if rank == 0:
            try:
                shm_all_reduce(rank, world, timeout_s=0.5)
                error = ""
            except RuntimeError as exc:
                error = str(exc)
            left = [p.name for p in Path("/dev/shm").glob("duet-tp-*")]
            torch.save({"error": error, "left": left}, f"{out_dir}/setup0.pt")
        else:
            dist.broadcast(torch.zeros(16, dtype=torch.uint8), 0)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_setup_whose_peer_never_maps_the_segment_fails_and_leaves_nothing(tmp_path):
    before = {p.name for p in Path("/dev/shm").glob("duet-tp-*")}
    mp.spawn(_setup_fails_main, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    result = torch.load(tmp_path / "setup0.pt")
    assert "waited" in result["error"]
    assert set(result["left"]) == before  # unlinked on the failed path too
