"""Time of one `runtime.sampling.sample` call at batch 1, 8 and 32 over DeepSeek's vocabulary,
this tree's sampler against an earlier one (a path to its runtime/sampling.py, e.g. a checkout of
main before counter-based sampling, whose `sample` took one torch.Generator per row).

    python -m bench.sampling --before /path/to/old/runtime/sampling.py [--threads 1]

Median (and minimum) of the calls, the two samplers interleaved so that drift hits both alike.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import sys
import time

import torch

from native import ops
from runtime import sampling

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


def time_case(before, kwargs: dict, batch: int, repeats: int) -> list[float]:
    """ms of one `sample` call on the same logits and parameters: the median before, after,
    then the minimum before, after (less sensitive to other work on the machine)."""
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
    old_times, new_times = old_times[2:], new_times[2:]
    return [1e3 * f(t) for f in (statistics.median, min) for t in (old_times, new_times)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="an earlier runtime/sampling.py")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()
    ops.set_num_threads(args.threads)
    before = load_before(args.before)
    print(f"sample() over V = {VOCAB}, {args.threads} thread(s), {2 * args.repeats - 2} calls (ms)")
    print(
        f"{'case':<18}{'batch':>6}{'median before':>15}{'after':>9}{'min before':>12}{'after':>9}"
    )
    for name, kwargs in CASES.items():
        for batch in (1, 8, 32):
            old_med, new_med, old_min, new_min = time_case(before, kwargs, batch, args.repeats)
            print(
                f"{name:<18}{batch:>6}{old_med:>15.3f}{new_med:>9.3f}{old_min:>12.3f}{new_min:>9.3f}"
            )


if __name__ == "__main__":
    main()
