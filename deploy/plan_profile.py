"""What `duet plan` measures on this machine: prefill forwards by length, decode steps by batch.

For each thread count, the model (loaded once) runs
- prefill: whole prompts of a few lengths up to the workload's input length, chunk by chunk as a
  prefill node does, with the node's chunk size and a quarter of it (or of the input length, so
  that chunks with a prefix are measured even when a prompt fits one chunk); every chunk's
  forward is one sample (new tokens, prefix length, seconds);
- decode: one decode step of `batch` requests whose contexts hold `context` tokens each (the
  mean context of the workload, input + half the output, and half of that: two contexts keep
  the per-request and per-context-token terms apart), for batch sizes 1, 2, 4, ... up to the
  largest asked; each is one sample (batch, total context tokens, seconds).
Each point is repeated and its median kept (the first run of each shape is a warm-up). The rows
written and read are real KV rows of the pool (contents do not change a forward's time).

A profile is plain JSON (`save` / `load`), so a planner run on another machine (or a later one
on this machine) can reuse it with `duet plan --profile FILE`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from control.errors import DuetError
from model.batch import ForwardBatch
from model.deepseek import DeepseekModel
from native.timing import time_call

PROFILE_VERSION = 1


@dataclass
class ThreadProfile:
    """Samples at one thread count: prefill [new, prefix, s] and decode [batch, context, s]."""

    prefill: list[list[float]] = field(default_factory=list)
    decode: list[list[float]] = field(default_factory=list)


@dataclass
class RoleProfile:
    model: str
    chunk_size: int
    page_size: int
    kv_bytes_per_token: int
    max_positions: int
    cpu_count: int
    by_threads: dict[int, ThreadProfile] = field(default_factory=dict)
    version: int = PROFILE_VERSION
    colocated: bool = False  # each role measured while the other ran beside it

    def save(self, path: str | Path) -> None:
        body = asdict(self)
        body["by_threads"] = {str(t): asdict(p) for t, p in self.by_threads.items()}
        Path(path).write_text(json.dumps(body, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> RoleProfile:
        try:
            body = json.loads(Path(path).read_text())
            if body.get("version") != PROFILE_VERSION:
                raise DuetError(f"{path}: profile version {body.get('version')}, want 1")
            by_threads = {int(t): ThreadProfile(**p) for t, p in body.pop("by_threads").items()}
            return cls(**body, by_threads=by_threads)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise DuetError(f"{path}: not a duet plan profile ({exc})") from None


def decode_batches(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to `max_batch` (included)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


def prefill_lengths(input_len: int, chunk_size: int) -> list[int]:
    """A few prompt lengths up to the input length: enough chunks and prefixes to fit the
    prefix-length term."""
    lengths = {input_len, max(1, input_len // 2), max(1, input_len // 4), min(input_len, 16)}
    lengths.add(min(input_len, 2 * chunk_size))
    return sorted(lengths)


def _median_seconds(run, repeats: int) -> float:
    """Median seconds of `run` after a warm-up (bench-kernels' timer, no budget to speak of)."""
    return time_call(run, repeats, budget_s=1e6)


def profile_prefill(
    model: DeepseekModel, lengths: list[int], chunk_size: int, page_size: int, repeats: int
) -> list[list[float]]:
    max_len = max(lengths)
    pool = model.new_kv_pool(-(-max_len // page_size) + 1, page_size)
    samples = []
    for length in lengths:
        table = pool.new_table()
        pool.reserve(table, length)
        ids = [(7 * i + 3) % model.cfg.vocab_size for i in range(length)]
        for start in range(0, length, chunk_size):
            chunk = ids[start : start + chunk_size]

            def run(chunk=chunk, start=start, table=table):
                batch = ForwardBatch.build(pool, [table], [chunk], [start], is_decode=False)
                model.forward(batch, pool)

            samples.append([len(chunk), start, _median_seconds(run, repeats)])
        pool.release(table)
    return samples


def profile_decode(
    model: DeepseekModel, batches: list[int], context: int, page_size: int, repeats: int
) -> list[list[float]]:
    max_pos = model.cfg.max_position_embeddings
    context = max(1, min(context, max_pos - 1))
    pages_each = -(-(context + 1) // page_size)
    pool = model.new_kv_pool(pages_each * max(batches), page_size)
    tables = [pool.new_table() for _ in range(max(batches))]
    for table in tables:
        pool.reserve(table, context + 1)
    samples = []
    for batch_size in batches:
        members = tables[:batch_size]

        def run(members=members):
            batch = ForwardBatch.build(
                pool, members, [[1]] * len(members), [context] * len(members), is_decode=True
            )
            model.forward(batch, pool)

        samples.append([batch_size, batch_size * context, _median_seconds(run, repeats)])
    return samples


def profile_roles(
    model_dir: str,
    thread_counts: list[int],
    input_len: int,
    output_len: int,
    max_batch: int,
    chunk_size: int = 256,
    page_size: int = 16,
    repeats: int = 3,
    dtype: torch.dtype = torch.bfloat16,
    log=print,
    colocated: bool = False,
) -> RoleProfile:
    """Loads the model once and measures both roles at every thread count; `colocated`: each
    while the other role runs beside it (`deploy.plan_neighbour`, same thread count)."""
    from native import ops

    model = DeepseekModel.from_pretrained(model_dir, dtype, progress=False)
    cfg = model.cfg
    input_len = max(1, min(input_len, cfg.max_position_embeddings - 2))
    context = min(input_len + output_len // 2, cfg.max_position_embeddings - 1)
    profile = RoleProfile(
        model=str(model_dir),
        chunk_size=chunk_size,
        page_size=page_size,
        kv_bytes_per_token=model.new_kv_pool(1, page_size).bytes_per_token,
        max_positions=cfg.max_position_embeddings,
        cpu_count=os.cpu_count() or 1,
        colocated=colocated,
    )
    before = torch.get_num_threads()
    try:
        for threads in thread_counts:
            ops.set_num_threads(threads)
            log(
                f"# profiling with {threads} thread(s): prefill up to {input_len} tokens, "
                f"decode batches up to {max_batch} at {context} tokens of context"
            )
            lengths, batches = prefill_lengths(input_len, chunk_size), decode_batches(max_batch)
            samples = ThreadProfile()
            beside = _Neighbour.of(colocated, model_dir, "decode", threads, context, chunk_size)
            with beside:
                for chunk in sorted({chunk_size, max(16, min(chunk_size, input_len) // 4)}):
                    samples.prefill += profile_prefill(model, lengths, chunk, page_size, repeats)
            beside = _Neighbour.of(colocated, model_dir, "prefill", threads, context, chunk_size)
            with beside:
                for ctx in sorted({context, max(1, context // 2)}):
                    samples.decode += profile_decode(model, batches, ctx, page_size, repeats)
            profile.by_threads[threads] = samples
    finally:
        ops.set_num_threads(before)
    return profile


class _Neighbour:
    """`deploy.plan_neighbour` running the other role while a block measures one (a no-op when
    not colocated); always terminated on the way out."""

    def __init__(self, cmd: list[str] | None):
        self.cmd, self.proc = cmd, None

    @classmethod
    def of(cls, colocated, model_dir, role, threads, context, chunk) -> _Neighbour:
        if not colocated:
            return cls(None)
        cmd = [sys.executable, "-m", "deploy.plan_neighbour", "--model", str(model_dir),
               "--role", role, "--threads", str(threads), "--context", str(context),
               "--chunk", str(chunk)]  # fmt: skip
        return cls(cmd)

    def __enter__(self) -> _Neighbour:
        if self.cmd is not None:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True)
            line = self.proc.stdout.readline()  # "ready" after its first forward, "" if it died
            if line.strip() != "ready":
                self.__exit__()
                raise DuetError(f"the profile's neighbour ({' '.join(self.cmd)}) did not start")
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.proc = None
