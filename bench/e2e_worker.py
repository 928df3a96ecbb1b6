"""One quantization of `duet bench-e2e`, measured in a process of its own (so the peak memory of
its load is its own): load, memory, weight bytes, TTFT, TPOT and teacher-forced log-probs.

The parent (`bench/e2e.py`) starts `python -m bench.e2e --worker QUANT --worker-out PREFIX ...`;
this module writes PREFIX.json (the row, or {"error": ...}) and PREFIX.pt (a dict of the held-out
`ids` and their next-token `logprobs` [N, V] fp32, for the parent's KL) and exits.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
import types
from pathlib import Path

import torch

from model.batch import ForwardBatch
from model.deepseek import DeepseekModel
from model.kv_pool import KVPool, PageTable

# Held-out text for the accuracy figures when the model has a tokenizer (repeated to length).
HELD_OUT_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin of "
    "oil and a notebook in which he wrote the weather, the ships he saw and the names of the "
    "birds that rested on the rail. In forty years he missed only three nights: once for a "
    "wedding, once for a funeral, and once because the storm of 1953 tore the door from its "
    "hinges. Visitors asked him whether he was lonely. He said that the sea was never the same "
    "twice, that the light needed him, and that a man who counts the waves has little time to "
    "count the hours. When the light was automated he moved to the village, and for a year he "
    "still woke at dusk, walked to the harbour wall and watched the beam turn without him."
)

# RoPE tables hang off the model and every attention layer; they are not weights.
NOT_WEIGHTS = frozenset({"cos_sin"})
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def proc_status() -> dict[str, int]:
    """RssAnon, RssFile and VmHWM of this process from /proc/self/status, in bytes."""
    fields = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024  # the kernel reports kB
    return fields


def _children(obj):
    """What a plain object holds: its __dict__ values and every __slots__ entry of its MRO."""
    if hasattr(obj, "__dict__"):
        yield from ((k, v) for k, v in vars(obj).items())
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if hasattr(obj, name):
                yield name, getattr(obj, name)


def held_tensor_bytes(root, skip: frozenset[str] = NOT_WEIGHTS) -> int:
    """Bytes of every tensor storage reachable from `root` through attributes (__dict__ and
    __slots__: packed-weight objects), lists, tuples and dict values, each storage counted once
    (views and shared tensors share one). Attributes named in `skip` are not followed."""
    seen_storages: set[int] = set()
    seen_objects: set[int] = set()
    total, stack = 0, [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen_storages:
                seen_storages.add(storage.data_ptr())
                total += storage.nbytes()
            continue
        if id(obj) in seen_objects or isinstance(obj, (str, bytes, int, float, *_OPAQUE)):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        else:
            stack.extend(value for name, value in _children(obj) if name not in skip)
    return total


def load_model(model_dir: str, quant: str, pack: str | None = None) -> DeepseekModel:
    """The model in bf16 with its weights in `quant` (a scheme of QUANT_SCHEMES: "none", "int8",
    "fp8", "int4"); "Q/A": with the attention projections in A; "Q+head": with the LM head in
    int8; "Q@pack": mapped from a pack of Q (`pack`, else the weights cache's, built once:
    model.pack_cache)."""
    from model.pack_cache import load_model as load

    scheme, _, via = quant.partition("@")
    scheme, _, head = scheme.partition("+")
    scheme, _, attention = scheme.partition("/")
    mapped = via == "pack"
    return load(
        model_dir,
        torch.bfloat16,
        scheme,
        progress=False,
        pack=pack if mapped else None,
        weights_cache=mapped,
        quant_lm_head=head == "head",
        quant_attention=attention or None,
    )


def prefill_batch(
    model: DeepseekModel,
    pool: KVPool,
    tables: list[PageTable],
    prompts: list[list[int]],
    chunk_size: int,
) -> torch.Tensor:
    """Prefills B prompts of one length together: per chunk one extend ForwardBatch holding
    `chunk_size` tokens of every prompt (OfflineGenerator.prefill's loop, batched). The tables
    must hold the prompts' pages. Returns each prompt's last-token logits [B, V] fp32."""
    (length,) = {len(p) for p in prompts}
    logits = None
    for start in range(0, length, chunk_size):
        chunks = [p[start : start + chunk_size] for p in prompts]
        batch = ForwardBatch.build(pool, tables, chunks, [start] * len(prompts), is_decode=False)
        logits = model.forward(batch, pool)
    return logits


def decode_step(model, pool, tables, tokens: list[int], position: int) -> torch.Tensor:
    """One decode forward of B sequences, each fed `tokens[i]` at `position`: logits [B, V]."""
    batch = ForwardBatch.build(pool, tables, [[t] for t in tokens], [position] * len(tokens), True)
    return model.forward(batch, pool)


def time_request(model, pool, prompts, decode_steps: int, chunk_size: int) -> tuple[float, float]:
    """(TTFT s: batched prefill + greedy first tokens, TPOT s: median decode step)."""
    tables = [pool.new_table() for _ in prompts]
    try:
        for table in tables:
            pool.reserve(table, len(prompts[0]) + decode_steps)
        start = time.perf_counter()
        tokens = prefill_batch(model, pool, tables, prompts, chunk_size).argmax(-1).tolist()
        ttft = time.perf_counter() - start
        steps = []
        for step in range(decode_steps):
            start = time.perf_counter()
            logits = decode_step(model, pool, tables, tokens, len(prompts[0]) + step)
            tokens = logits.argmax(-1).tolist()
            steps.append(time.perf_counter() - start)
        return ttft, statistics.median(steps)
    finally:
        for table in tables:
            pool.release(table)


def held_out_ids(model_dir: str, vocab_size: int, num_tokens: int, seed: int) -> list[int]:
    """The accuracy text: HELD_OUT_TEXT tokenized (repeated to length) if the model has a
    tokenizer, else ids drawn from a generator seeded with `seed`."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        from control.tokenizer import Tokenizer

        text_ids = Tokenizer(model_dir).encode(HELD_OUT_TEXT)
        ids = (text_ids * (num_tokens // len(text_ids) + 1))[:num_tokens]
        if all(0 <= t < vocab_size for t in ids):
            return ids
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=gen).tolist()


def teacher_forced_logprobs(model, pool, ids: list[int], chunk_size: int) -> torch.Tensor:
    """[N, V] fp32: log-softmax of the next-token logits at every position of `ids`, prefilled
    in chunks with the logits of every token of a chunk returned (`extra_logit_index`)."""
    table = pool.new_table()
    rows = []
    try:
        pool.reserve(table, len(ids))
        for start in range(0, len(ids), chunk_size):
            chunk = ids[start : start + chunk_size]
            batch = ForwardBatch.build(pool, [table], [chunk], [start], is_decode=False)
            batch.extra_logit_index = torch.arange(len(chunk) - 1)
            logits = model.forward(batch, pool)  # [the chunk's last token, then 0 .. len - 2]
            rows.append(torch.cat((logits[1:], logits[:1])))
    finally:
        pool.release(table)
    return torch.log_softmax(torch.cat(rows), dim=-1)


def measure(args, quant: str, logprobs_path: Path) -> dict:
    from native import ops

    if args.threads:
        ops.set_num_threads(args.threads)
    base = proc_status()
    start = time.perf_counter()
    model = load_model(args.model, quant, args.pack)
    load_s = time.perf_counter() - start
    gc.collect()
    after = proc_status()  # VmHWM now: the peak of the load (nothing else has run yet)
    row = {
        "quant": quant,
        "load_s": load_s,
        "weights_bytes": held_tensor_bytes(model),
        "base_rss_bytes": base["RssAnon"] + base["RssFile"],
        "rss_anon_bytes": after["RssAnon"],
        "rss_file_bytes": after["RssFile"],
        "resident_bytes": after["RssAnon"] + after["RssFile"],
        "peak_bytes": after["VmHWM"],
    }
    cfg, page = model.cfg, args.page_size
    seq_pages = -(-(args.prompt_len + args.decode_steps) // page)
    pool = model.new_kv_pool(max(args.batch * seq_pages, -(-args.kl_tokens // page)), page)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=gen)
    prompts = prompts.tolist()
    with torch.inference_mode():
        time_request(model, pool, prompts, args.decode_steps, args.chunk_size)  # warm-up
        runs = [
            time_request(model, pool, prompts, args.decode_steps, args.chunk_size)
            for _ in range(args.repeats)
        ]
        row["ttft_s"] = statistics.median(r[0] for r in runs)
        row["tpot_s"] = statistics.median(r[1] for r in runs)
        if args.kl_tokens:
            ids = held_out_ids(args.model, cfg.vocab_size, args.kl_tokens, args.seed)
            logprobs = teacher_forced_logprobs(model, pool, ids, args.chunk_size)
            torch.save({"ids": torch.tensor(ids), "logprobs": logprobs}, logprobs_path)
            row["logprobs_file"] = str(logprobs_path)
    return row


def run(args) -> int:
    """Worker entry: writes PREFIX.json with the row, or {"quant", "error"}; 0 on success."""
    prefix = Path(args.worker_out)
    try:
        row, rc = measure(args, args.worker, prefix.with_suffix(".pt")), 0
    except Exception as exc:  # any failure becomes this row's error; the other rows still run
        row, rc = {"quant": args.worker, "error": f"{type(exc).__name__}: {exc}"}, 1
    prefix.with_suffix(".json").write_text(json.dumps(row))
    return rc
