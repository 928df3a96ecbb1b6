"""Time of one `engine.sampling.sample` call at batch 1, 8 and 32 over DeepSeek's vocabulary,
this tree's sampler against an earlier one (a path to its engine/sampling.py, e.g. a checkout of
main before counter-based sampling, whose `sample` took one torch.Generator per row).

    python -m bench.sampling --before /path/to/old/engine/sampling.py [--threads 1]

Median of `--repeats` calls, the two samplers interleaved so that drift hits both alike.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import sys
import time

import torch

from engine import sampling
from native import ops

VOCAB = 102400
CASES = {"temperature 0.8": dict(temperature=0.8), "+ top_p 0.9": dict(temperature=0.8, top_p=0.9)}


def load_before(path: str):
    spec = importlib.util.spec_from_file_location("sampling_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def time_case(before, kwargs: dict, batch: int, repeats: int) -> tuple[float, float]:
    """Median ms of one `sample` call, (before, after), on the same logits and parameters."""
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 3
    old_params = [before.SamplingParams(seed=i, **kwargs) for i in range(batch)]
    new_params = [sampling.SamplingParams(seed=i, **kwargs) for i in range(batch)]
    gens = [q.make_generator() for q in old_params]
    old_call = functools.partial(before.sample, logits, old_params, gens)
    new_call = functools.partial(sampling.sample, logits, new_params, range(batch), [5] * batch)
    old_times, new_times = [], []
    for _ in range(2):  # interleaved halves; the first calls of each warm up
        old_times += timed(old_call, repeats)
        new_times += timed(new_call, repeats)
    return statistics.median(old_times[2:]) * 1e3, statistics.median(new_times[2:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="an earlier engine/sampling.py")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()
    ops.set_num_threads(args.threads)
    before = load_before(args.before)
    print(f"sample() over V = {VOCAB}, {args.threads} thread(s), median of {args.repeats} (ms)")
    print(f"{'case':<18}{'batch':>6}{'before':>10}{'after':>10}{'speedup':>9}")
    for name, kwargs in CASES.items():
        for batch in (1, 8, 32):
            old_ms, new_ms = time_case(before, kwargs, batch, args.repeats)
            print(f"{name:<18}{batch:>6}{old_ms:>10.3f}{new_ms:>10.3f}{old_ms / new_ms:>8.1f}x")


if __name__ == "__main__":
    main()
