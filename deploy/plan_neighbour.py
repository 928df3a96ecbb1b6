"""The other role, running beside a `duet plan` profile: `python -m deploy.plan_neighbour`.

Nodes that share a host share its memory bandwidth and caches even when each has cores of its
own: a decode step (memory-bound) slows while a prefill node computes beside it, and the
prefill slows too. With `duet plan --colocated`, each role is profiled while this process keeps
the other one busy: decode steps of `--batch` requests at `--context` tokens, or prefill forwards
of `--chunk` tokens, in a loop on `--threads` threads until it is terminated. It prints `ready`
once its first forward is done, so the profile starts under load.
"""

from __future__ import annotations

import argparse
import signal
import sys

import torch

from model.batch import ForwardBatch
from model.deepseek import DeepseekModel


def main(argv: list[str] | None = None) -> int:
    from native import ops

    p = argparse.ArgumentParser(prog="python -m deploy.plan_neighbour")
    p.add_argument("--model", required=True)
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8, help="decode: running requests")
    p.add_argument("--context", type=int, default=256, help="decode: tokens each request holds")
    p.add_argument("--chunk", type=int, default=256, help="prefill: tokens a forward")
    p.add_argument("--page-size", type=int, default=16)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ops.set_num_threads(args.threads)
    model = DeepseekModel.from_pretrained(args.model, torch.bfloat16, progress=False)
    tokens = args.batch * (args.context + 1) if args.role == "decode" else args.chunk
    pool = model.new_kv_pool(-(-tokens // args.page_size) + args.batch, args.page_size)
    if args.role == "decode":
        tables = [pool.new_table() for _ in range(args.batch)]
        for table in tables:
            pool.reserve(table, args.context + 1)
        batch = ForwardBatch.build(
            pool, tables, [[1]] * args.batch, [args.context] * args.batch, is_decode=True
        )
    else:
        table = pool.new_table()
        pool.reserve(table, args.chunk)
        ids = [(5 * i + 1) % model.cfg.vocab_size for i in range(args.chunk)]
        batch = ForwardBatch.build(pool, [table], [ids], [0], is_decode=False)
    model.forward(batch, pool)
    print("ready", flush=True)
    while True:
        model.forward(batch, pool)


if __name__ == "__main__":
    sys.exit(main())
