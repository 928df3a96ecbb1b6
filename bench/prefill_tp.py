"""Prefill with tensor parallelism: ranks = 1 (T threads) vs ranks = R (T/R each),
for each scheme ("tp", "tp_sp": `--schemes`) and collectives (gloo, shm: `--comm`).

On the bench shapes (`tinymodel.bench_model`, `--layers` layers written to a temporary directory,
or `--model DIR`), each configuration runs in fresh processes joined by gloo on loopback, with
the model transform a tensor-parallel prefill node uses ("tp", `model.tensor_parallel`: heads,
MLP columns and routed experts split, an all-reduce after every o_proj and MLP; "tp_sp",
`model.sequence_parallel`: heads split, the rest sequence-split, an all-gather and an
all-to-all a layer), over gloo or the shared-memory segment. It times the prefill of one
`--prompt-len` prompt in `--chunk` token chunks (the extend path, each chunk over the ones
before as its prefix), `--repeats` times after one warm-up, and reports the median seconds,
the R-rank / 1-rank throughput ratio, the collectives' share of rank 0's time (their wall
time, waiting for the peer included) and the bytes handed to them per layer. The
configurations alternate (1, R..., 1, R...: `--rounds`): this host's DRAM rate drifts. Each
rank of R > 1 runs on its share of the cores, as a prefill node's ranks do (`--pin auto`,
`control.placement`). `--dry-run` only prints the bytes a rank sends per layer under each
scheme (`model.tensor_parallel.traffic_per_layer`) and runs nothing.

    python -m bench.prefill_tp [--layers 2 --prompt-len 2048 --chunk 512 --threads 2 --ranks 2
        --comm gloo,shm --schemes tp,tp_sp --rounds 2 --repeats 3 --pin auto]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from control.model_config import ModelConfig
from control.placement import numa_nodes, plan_rank
from deploy.local_cluster import free_port
from model.batch import ForwardBatch
from model.deepseek import DeepseekModel
from model.sequence_parallel import install_sequence_parallel
from model.tensor_parallel import (
    gloo_all_reduce,
    install_tensor_parallel,
    shm_all_reduce,
    traffic_per_layer,
)
from native import ops


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.prefill_tp", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", help="checkpoint dir (default: a bench model written to a tmp dir)")
    p.add_argument("--layers", type=int, default=2, help="bench model layers (first dense)")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    p.add_argument("--threads", type=int, default=2, help="kernel threads in all, per config")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed prefills per configuration run")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the configurations")
    p.add_argument("--comm", default="gloo,shm", help="collectives to compare: gloo, shm")
    p.add_argument("--schemes", default="tp,tp_sp", help="parallel schemes to compare")
    p.add_argument(
        "--pin",
        choices=("auto", "off"),
        default="auto",
        help="the ranks' cores, as a prefill node's `pin` (default auto)",
    )
    p.add_argument("--dry-run", action="store_true", help="the schemes' traffic per layer only")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


class _TimedComm:
    """The collectives (the all-reduce called, all_gather, all_to_all), timed, with the bytes
    each call hands in (the all-reduce's in fp32, as it sums)."""

    def __init__(self, inner):
        self.inner, self.seconds, self.bytes = inner, 0.0, []

    def _timed(self, fn, x: torch.Tensor, nbytes: int) -> torch.Tensor:
        started = time.perf_counter()
        out = fn(x)
        self.seconds += time.perf_counter() - started
        self.bytes.append(nbytes)
        return out

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        return self._timed(self.inner, partial, partial.numel() * 4)

    def all_gather(self, part: torch.Tensor) -> torch.Tensor:
        return self._timed(self.inner.all_gather, part, part.numel() * part.element_size())

    def all_to_all(self, pieces: torch.Tensor) -> torch.Tensor:
        return self._timed(self.inner.all_to_all, pieces, pieces.numel() * pieces.element_size())


def _rank_main(
    rank,
    world,
    port,
    model_dir,
    threads,
    prompt_len,
    chunk,
    repeats,
    comm,
    out_dir,
    allowed_cpus,
    scheme,
):
    if allowed_cpus and world > 1:  # as a prefill node's ranks with pin = "auto"
        os.sched_setaffinity(0, plan_rank(rank, world, allowed_cpus, numa_nodes()).cpus)
    ops.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        tp = (rank, world) if world > 1 else None
        model = DeepseekModel.from_pretrained(
            model_dir, torch.bfloat16, progress=False, tensor_parallel=tp, parallel=scheme
        )
        reduce = _TimedComm(
            gloo_all_reduce() if comm == "gloo" or tp is None else shm_all_reduce(rank, world)
        )
        if tp is not None and scheme == "tp_sp":
            install_sequence_parallel(model, reduce)
        elif tp is not None:
            install_tensor_parallel(model, reduce)
        pool = model.new_kv_pool(num_pages=-(-prompt_len // 64) + 1, page_size=64)
        ids = torch.randint(
            0, model.cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)
        ).tolist()

        def prefill():
            table = pool.new_table()
            pool.reserve(table, prompt_len)
            for start in range(0, prompt_len, chunk):
                tokens = ids[start : start + chunk]
                fb = ForwardBatch.build(pool, [table], [tokens], [start], is_decode=False)
                model.forward(fb, pool)
            pool.release(table)

        prefill()  # warm-up
        seconds, comm = [], []
        for _ in range(repeats):
            dist.barrier()
            reduce.seconds, reduce.bytes = 0.0, []
            started = time.perf_counter()
            prefill()
            seconds.append(time.perf_counter() - started)
            comm.append(reduce.seconds)
        per_layer = sum(reduce.bytes) / max(1, model.cfg.num_hidden_layers)
        result = {"seconds": seconds, "comm_seconds": comm, "bytes_per_layer": per_layer}
        json.dump(result, open(f"{out_dir}/rank{rank}.json", "w"))
    finally:
        dist.destroy_process_group()


def run_config(model_dir, world, threads, args, comm="gloo", scheme="tp") -> dict:
    with tempfile.TemporaryDirectory() as out:
        allowed_cpus = sorted(os.sched_getaffinity(0)) if args.pin == "auto" else None
        params = (world, free_port(), str(model_dir), threads, args.prompt_len, args.chunk,
                  args.repeats, comm, out, allowed_cpus, scheme)  # fmt: skip
        mp.spawn(_rank_main, args=params, nprocs=world, join=True)
        return json.load(open(Path(out) / "rank0.json"))


def dry_run(args) -> int:
    if args.model:
        cfg = ModelConfig.from_model_dir(args.model)
    else:
        from tinymodel.bench_model import bench_config

        cfg = ModelConfig.from_dict(bench_config(args.layers, 102400, 0, 1))
    traffic = traffic_per_layer(cfg, args.prompt_len, args.ranks)
    if args.json:
        print(json.dumps({"prompt_len": args.prompt_len, "ranks": args.ranks, **traffic}))
        return 0
    print(
        f"bytes one rank sends per layer, {args.prompt_len} tokens over {args.ranks} ranks "
        f"(hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads):"
    )
    for scheme, sent in traffic.items():
        print(f"  {scheme:22s} {sent / 2**20:8.2f} MiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    if args.threads % args.ranks:
        raise SystemExit(f"error: --threads {args.threads} must split evenly over --ranks")
    configs = [(s, c) for s in args.schemes.split(",") for c in args.comm.split(",")]
    names = [f"{s}_{c}" for s, c in configs]
    runs: dict[str, list[dict]] = {"1": [], **{n: [] for n in names}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from tinymodel.bench_model import make_bench_model

            model_dir = make_bench_model(Path(tmp) / "bench", layers=args.layers, progress=False)
        for _ in range(args.rounds):
            runs["1"].append(run_config(model_dir, 1, args.threads, args))
            for name, (scheme, comm) in zip(names, configs, strict=True):
                threads = args.threads // args.ranks
                runs[name].append(run_config(model_dir, args.ranks, threads, args, comm, scheme))
    one = statistics.median(s for r in runs["1"] for s in r["seconds"])
    report = {
        "prompt_len": args.prompt_len, "chunk": args.chunk, "layers": args.layers,
        "ranks1": {"threads": args.threads, "median_s": one,
                   "all": [s for r in runs["1"] for s in r["seconds"]]},
    }  # fmt: skip
    for comm in names:
        many_runs = runs[comm]
        many = statistics.median(s for r in many_runs for s in r["seconds"])
        share = statistics.median(
            c / s for r in many_runs for s, c in zip(r["seconds"], r["comm_seconds"], strict=True)
        )
        report[f"ranks{args.ranks}_{comm}"] = {
            "threads_per_rank": args.threads // args.ranks, "median_s": many,
            "all": [s for r in many_runs for s in r["seconds"]], "all_reduce_share": share,
            "comm_bytes_per_layer": many_runs[0]["bytes_per_layer"],
            "throughput_ratio": one / many,
        }  # fmt: skip
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"prefill of {args.prompt_len} tokens in chunks of {args.chunk}, {args.layers} layers")
    print(f"  1 rank x {args.threads} threads: {one:.3f} s (median)")
    for comm in names:
        r = report[f"ranks{args.ranks}_{comm}"]
        print(
            f"  {args.ranks} ranks x {r['threads_per_rank']} threads, {comm}: "
            f"{r['median_s']:.3f} s (median), {r['throughput_ratio']:.2f}x of 1 rank, "
            f"collectives {r['all_reduce_share']:.1%} of rank 0's time, "
            f"{r['comm_bytes_per_layer'] / 2**20:.1f} MiB handed to them per layer"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
