"""The timing phase of `duet bench-e2e`: every quantization loaded in ONE process and timed in
interleaved rounds (none, int8, int4, none, int8, ...), so that each round's ratios compare runs
made within seconds of each other. This machine's DRAM rate swings by up to ~1.7x within
minutes: timing each quantization in its own process, one after the other, measures those
swings as much as the quantization. The memory figures stay the per-process ones.

Writes PREFIX.json: {quant: {"ttft_s": [per round], "tpot_s": [per round]}}.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.e2e_worker import load_model, time_request


def time_interleaved(args, quants: list[str]) -> dict[str, dict[str, list[float]]]:
    from native import ops

    if args.threads:
        ops.set_num_threads(args.threads)
    models = {q: load_model(args.model, q, args.pack) for q in dict.fromkeys(quants)}
    first = next(iter(models.values()))
    page = args.page_size
    pages = args.batch * -(-(args.prompt_len + args.decode_steps) // page)
    pools = {q: m.new_kv_pool(pages, page) for q, m in models.items()}
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(
        0, first.cfg.vocab_size, (args.batch, args.prompt_len), generator=gen
    ).tolist()
    out = {q: {"ttft_s": [], "tpot_s": []} for q in models}
    with torch.inference_mode():
        for q, m in models.items():  # warm-up
            time_request(m, pools[q], prompts, args.decode_steps, args.chunk_size)
        for _ in range(args.repeats):
            for q, m in models.items():
                ttft, tpot = time_request(m, pools[q], prompts, args.decode_steps, args.chunk_size)
                out[q]["ttft_s"].append(ttft)
                out[q]["tpot_s"].append(tpot)
    return out


def run(args) -> int:
    quants = args.timing_quants.split(",")
    prefix = Path(args.worker_out)
    try:
        result, rc = time_interleaved(args, quants), 0
    except Exception as exc:  # reported by the parent as the timing phase's error
        result, rc = {"error": f"{type(exc).__name__}: {exc}"}, 1
    prefix.with_suffix(".json").write_text(json.dumps(result))
    return rc
