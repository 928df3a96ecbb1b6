"""Decode throughput of the EP/DP layout: ranks = 1 (T threads) vs ranks = R (T/R threads each).

On the bench shapes (`tinymodel.bench_model`: DeepSeek-V2-Lite layers, 64 experts top-6, written
with `--layers` layers into a temporary directory, or `--model DIR`), each configuration runs in
fresh processes joined by gloo on loopback, exactly the model transform the decode node uses.
For a global batch of B requests (split evenly over the ranks, each with `--context` tokens of
cache) it times `--steps` decode steps after 2 warm-up steps, and reports decode tokens/s
(B x steps / wall time on rank 0) and, for R > 1, the share of rank 0's step time spent in the
dispatch/combine exchanges (their wall time, waiting for the peer included).

    python -m bench.decode_ranks [--layers 2 --batches 1,8,32 --threads 2 --ranks 2 --json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from control.model_config import ModelConfig
from decode_node.expert_parallel import ExpertParallel, expert_shard
from model.batch import ForwardBatch
from model.deepseek import DeepseekModel
from native import ops


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.decode_ranks", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", help="checkpoint dir (default: a bench model written to a tmp dir)")
    p.add_argument("--layers", type=int, default=2, help="bench model layers (first dense)")
    p.add_argument("--batches", default="1,8,32", help="global decode batch sizes")
    p.add_argument("--threads", type=int, default=2, help="kernel threads in all, per config")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the EP/DP configuration")
    p.add_argument("--context", type=int, default=256, help="cached tokens per request")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per batch")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def _rank_main(rank, world, port, model_dir, threads, batches, context, steps, out_dir):
    ops.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        num_experts = ModelConfig.from_model_dir(model_dir).n_routed_experts
        shard = expert_shard(num_experts, rank, world) if world > 1 else None
        model = DeepseekModel.from_pretrained(model_dir, torch.bfloat16, shard, progress=False)
        ep = ExpertParallel(model, rank, world) if world > 1 else None
        results = {}
        for batch in batches:
            mine = batch // world + (rank < batch % world)  # DP: the batch split over ranks
            results[batch] = _time_batch(model, ep, mine, context, steps)
        json.dump(results, open(f"{out_dir}/rank{rank}.json", "w"))
    finally:
        dist.destroy_process_group()


def _time_batch(model, ep, num_seqs, context, steps):
    pool = model.new_kv_pool(
        num_pages=-(-(context + steps + 4) // 64) * max(1, num_seqs) + 1, page_size=64
    )
    tables = [pool.new_table() for _ in range(num_seqs)]
    for table in tables:
        pool.reserve(table, context + steps + 3)
    gen = torch.Generator().manual_seed(0)

    def one_step(i):
        if not num_seqs:
            ep.idle_step()
            return
        ids = torch.randint(0, model.cfg.vocab_size, (num_seqs,), generator=gen).tolist()
        fb = ForwardBatch.build(pool, tables, [[t] for t in ids], [context + i] * num_seqs, True)
        model.forward(fb, pool)

    for i in range(2):
        one_step(i)
    dist.barrier()
    comm0 = ep.comm_seconds if ep else 0.0
    started = time.perf_counter()
    for i in range(2, 2 + steps):
        one_step(i)
    dist.barrier()
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "comm_seconds": (ep.comm_seconds if ep else 0.0) - comm0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(model_dir, world, threads, batches, context, steps) -> dict:
    with tempfile.TemporaryDirectory() as out:
        args = (world, _free_port(), str(model_dir), threads, batches, context, steps, out)
        mp.spawn(_rank_main, args=args, nprocs=world, join=True)
        rank0 = json.load(open(Path(out) / "rank0.json"))
    return {
        int(b): {
            "tokens_per_s": int(b) * steps / r["seconds"],
            "dispatch_combine_share": r["comm_seconds"] / r["seconds"],
        }
        for b, r in rank0.items()
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.threads % args.ranks:
        raise SystemExit(f"error: --threads {args.threads} must split evenly over --ranks")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from tinymodel.bench_model import make_bench_model

            model_dir = make_bench_model(Path(tmp) / "bench", layers=args.layers, progress=False)
        common = (batches, args.context, args.steps)
        one = run_config(model_dir, 1, args.threads, *common)
        many = run_config(model_dir, args.ranks, args.threads // args.ranks, *common)
    report = {
        "cpus": os.cpu_count(), "layers": args.layers, "context": args.context,
        "ranks1": {"threads": args.threads, **one},
        f"ranks{args.ranks}": {"threads_per_rank": args.threads // args.ranks, **many},
    }  # fmt: skip
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"decode tokens/s, bench shapes ({args.layers} layers), context {args.context}")
    print(
        f"{'batch':>6} {'R=1 x' + str(args.threads) + 't':>10} "
        f"{'R=' + str(args.ranks) + ' x' + str(args.threads // args.ranks) + 't':>10} "
        f"{'ratio':>6} {'dispatch/combine share':>24}"
    )
    for b in batches:
        a, m = one[b], many[b]
        print(
            f"{b:>6} {a['tokens_per_s']:>10.2f} {m['tokens_per_s']:>10.2f} "
            f"{m['tokens_per_s'] / a['tokens_per_s']:>6.2f} "
            f"{100 * m['dispatch_combine_share']:>23.1f}%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
