"""TPOT with MTP speculative decoding against without, on the trained tiny model.

Greedy generation of `--tokens` tokens after the first 300 characters of each held-out stdlib
file (text the model never trained on), offline (`OfflineGenerator` against
`SpeculativeGenerator`, the decode node's twin), one thread, in interleaved rounds: per prompt
and round, the decode time (generation less its prefill) per token after the first. Reports
the medians, their ratio and the MTP layer's acceptance.

    python -m bench.mtp_tiny [--drafts 1,2 --tokens 64 --prompts 8 --rounds 3] [--draft-head H]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from control.quant_schemes import DEFAULT_DRAFT_HEAD, DRAFT_HEAD_SCHEMES
from control.sampling_params import SamplingParams
from control.tokenizer import Tokenizer
from model.deepseek import DeepseekModel
from native import ops
from runtime.generate import OfflineGenerator
from runtime.speculative_generate import SpeculativeGenerator
from tinymodel.make import ensure_tiny_model
from tinymodel.train_data import load_corpus


def decode_ms_per_token(generator, ids: list[int], params: SamplingParams) -> float:
    table = generator.pool.new_table()
    started = time.perf_counter()
    generator.prefill(table, ids)
    prefill = time.perf_counter() - started
    generator.pool.release(table)
    started = time.perf_counter()
    out = generator.generate(ids, params).token_ids
    return (time.perf_counter() - started - prefill) * 1000 / (len(out) - 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mtp_tiny", description=__doc__.split("\n")[0])
    p.add_argument("--drafts", default="1,2")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--draft-head", choices=DRAFT_HEAD_SCHEMES, default=DEFAULT_DRAFT_HEAD)
    args = p.parse_args(argv)
    ops.set_num_threads(1)
    model_dir = ensure_tiny_model()
    model = DeepseekModel.from_pretrained(
        model_dir, getattr(torch, args.dtype), progress=False, mtp=True
    )
    model.set_draft_head(args.draft_head)
    tok = Tokenizer(model_dir)
    prompts = [tok.encode_prompt(t[:300]) for t in load_corpus().held_out[: args.prompts]]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.tokens, ignore_eos=True)
    plain = OfflineGenerator(model)
    specs = {int(k): SpeculativeGenerator(model, int(k)) for k in args.drafts.split(",")}
    times: dict[str, list[float]] = {"plain": [], **{f"mtp{k}": [] for k in specs}}
    for _ in range(args.rounds):
        for ids in prompts:
            times["plain"].append(decode_ms_per_token(plain, ids, params))
            for k, spec in specs.items():
                times[f"mtp{k}"].append(decode_ms_per_token(spec, ids, params))
    base = statistics.median(times["plain"])
    print(
        f"trained tiny model, {args.dtype}, draft head {args.draft_head}, 1 thread, "
        f"{len(prompts)} held-out prompts x "
        f"{args.rounds} rounds, {args.tokens} tokens"
    )
    print(f"plain: TPOT {base:.3f} ms")
    for k, spec in specs.items():
        tpot = statistics.median(times[f"mtp{k}"])
        print(
            f"mtp_tokens {k}: TPOT {tpot:.3f} ms ({tpot / base:.2f}x), acceptance "
            f"{spec.acceptance_rate:.2f}, tokens/step "
            f"{(spec.num_accepted + spec.num_steps) / spec.num_steps:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
