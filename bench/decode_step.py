"""The decode node's step, profiled: how much of it is Python.

A real `DecodeNode` (in-process queues and KV receiver, no sockets) holds B running requests of
`--context` cached tokens each (the KV rows are whatever the pool holds: the timing does not
depend on them); `--steps` calls of `node.step()` run under cProfile after warm-up. Reported per
batch size: the step's wall time (median of the steps, timed without the profiler) and, from
the profile, the share of the step spent in Python (function bodies, not inside any C call),
the share inside this project's kernels (`native._C`), and inside torch's C functions.

With `--mtp-tokens K` the node speculates (the model needs an MTP layer: `duet
make-bench-model --mtp`); `--accept P` replaces the drafts by the right tokens with
probability P (the MTP layer still runs: its cost is in the figures), so TPOT can be measured
at a stated acceptance on a random-weight model, whose own drafts are almost never right.

With `--overlap on|both` the node's side work runs on its helper thread beside the forward
(`decode_node.step_overlap`): only the step time is reported then (the profiler sees one
thread).

    python -m bench.decode_step --model DIR [--batches 1,8,32 --context 256 --threads 2]
        [--quant none|int8|fp8|int4] [--quant-lm-head] [--overlap off|on|both]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import time

import torch

import decode_node.speculative_step as speculative_step
from bench.step_phases import phase_timers
from bench.step_split import profile_split, timed_split
from control import protocol
from control.cluster_config import DecodeNodeConfig, TimeoutConfig
from control.messaging import QueueInbox
from control.quant_schemes import DEFAULT_DRAFT_HEAD, DRAFT_HEAD_SCHEMES, QUANT_SCHEMES
from control.sampling_params import SamplingParams
from decode_node.node import DecodeNode
from decode_node.scheduler import DecodeState
from kvtransfer import InprocReceiver, make_fingerprint
from model.deepseek import DeepseekModel
from native import ops

SHARE_KEYS = ("python_share", "native_kernel_share", "torch_c_share")
TIMED_KEYS = ("outside_kernels_share", "native_kernel_share")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.decode_step", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", required=True, help="checkpoint dir (e.g. duet make-bench-model)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=256, help="cached tokens per request")
    p.add_argument("--steps", type=int, default=20, help="timed steps per batch size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mtp-tokens", type=int, default=0, help="speculate with K drafts (0: off)")
    p.add_argument("--accept", type=float, default=None, help="forced draft acceptance in [0, 1]")
    p.add_argument(
        "--draft-head",
        choices=DRAFT_HEAD_SCHEMES,
        default=DEFAULT_DRAFT_HEAD,
        help="the LM head the MTP drafts run through (model.draft_head)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--quant", choices=QUANT_SCHEMES, default="none", help="the weights' scheme")
    p.add_argument("--quant-lm-head", action="store_true", help="the LM head in int8")
    p.add_argument(
        "--overlap",
        choices=("off", "on", "both"),
        default="off",
        help="the overlapped step (the loop's work on a helper thread); 'both' runs each batch size "
        "in order, then overlapped, then in order again (the host's DRAM rate drifts)",
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="also time the main forward (the verify pass) and the MTP draft pass per step, and "
        "count the routed experts each MoE layer of the main forward reads",
    )
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


class EncodingOutbox:
    """What a node's ZeroMQ outbox does with a message before its socket: encode it. (The
    in-process QueueOutbox also decodes it again, the router's work, in another process.)"""

    def __init__(self) -> None:
        self.bytes_sent = 0

    def send(self, msg) -> bool:
        self.bytes_sent += len(protocol.encode(msg))
        return True

    def take(self) -> list:
        return []

    def close(self) -> None:
        pass


def make_node(
    model: DeepseekModel, batch: int, context: int, steps: int, mtp_tokens: int, overlap: bool
):
    page_size = 16
    # Four passes of `steps` (timed, cProfile, timers, phases) after 3 warm-ups, each step up
    # to mtp_tokens + 1 tokens.
    need = batch * (-(-(context + 4 * (steps + 3) * (mtp_tokens + 1) + 64) // page_size) + 1)
    pool = model.new_kv_pool(need, page_size)
    fp = make_fingerprint(
        model.cfg.fingerprint(), model.num_kv_layers, model.cfg.kv_row_width, model.dtype
    )
    cfg = DecodeNodeConfig(
        "bench",
        max_batch=batch,
        num_pages=need,
        page_size=page_size,
        kv_reservation="worst_case",
        mtp=mtp_tokens > 0,
        mtp_tokens=max(1, mtp_tokens),
        overlap=overlap,
    )
    return DecodeNode(
        "bench",
        model,
        cfg,
        TimeoutConfig(decode_s=3600),
        QueueInbox(),
        EncodingOutbox(),
        InprocReceiver(pool, fp),
    )


def add_requests(node: DecodeNode, batch: int, context: int, max_new: int, temperature: float):
    """B requests straight into the scheduler, KV 'received' (the pool's rows as they are)."""
    now = time.monotonic()
    for i in range(batch):
        params = SamplingParams(
            temperature=temperature, max_new_tokens=max_new, ignore_eos=True, seed=i
        )
        request, why = node.scheduler.reserve(f"r{i}", i, context, params, now)
        if request is None:
            raise RuntimeError(why)
        node.scheduler.kv_ready(f"r{i}", 5 + i, now, 3600.0, (), (7 + i,))


def force_acceptance(p: float, vocab: int) -> None:
    """Drafts become the token the main model will pick with probability p: greedy decoding
    of a random model is deterministic but unknown ahead, so 'right' is emulated by replacing
    the verify step's target instead: the acceptance test sees the draft as the target's
    argmax with probability p."""
    rng = random.Random(0)
    real = speculative_step.accept_tokens

    def accept(logits, drafts, params, *stream):
        logits = logits.clone()
        for j, d in enumerate(drafts):
            if rng.random() < p:
                logits[j, d] = logits[j].max() + 10.0
            else:
                break
        return real(logits, drafts, params, *stream)

    speculative_step.accept_tokens = accept


def run_batch(model, batch, args, overlap: bool) -> dict:
    """One batch size's figures; with `overlap`, no profile (cProfile sees only one thread)."""
    node = make_node(model, batch, args.context, args.steps, args.mtp_tokens, overlap)
    max_new = 2 + 4 * (args.steps + 3) * (args.mtp_tokens + 1)
    add_requests(node, batch, args.context, max_new, args.temperature)
    for _ in range(3):  # warm-up
        node.step()
        node.outbox.take()
    walls = []
    tokens_before = sum(len(r.output_ids) for r in node.scheduler.requests)
    for _ in range(args.steps):
        started = time.perf_counter()
        node.step()
        walls.append(time.perf_counter() - started)
        node.outbox.take()
    tokens = sum(len(r.output_ids) for r in node.scheduler.requests) - tokens_before
    shares = dict.fromkeys(SHARE_KEYS, float("nan"))
    timed = dict.fromkeys(TIMED_KEYS, float("nan"))

    def step():
        node.step()
        node.outbox.take()

    if not overlap:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            step()
        profile.disable()
        shares = profile_split(pstats.Stats(profile))
        timed = timed_split(step, args.steps)
    phases = {}
    if args.phases:
        with phase_timers(model) as timers:
            for _ in range(args.steps):
                step()
        phases = timers.per_step(args.steps)
    assert all(r.state == DecodeState.RUNNING for r in node.scheduler.requests)
    out = {
        "batch": batch,
        "overlap": overlap,
        "step_ms": statistics.median(walls) * 1000,
        "tpot_ms": sum(walls) * 1000 / (tokens / batch),
        "tokens_per_step": tokens / (batch * args.steps),
        **shares,
        **{f"timed_{k}": v for k, v in timed.items()},
        **phases,
    }
    if node.speculative is not None:
        out["acceptance"] = node.speculative.stats.acceptance_rate
    node.close("bench over")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ops.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = DeepseekModel.from_pretrained(
        args.model,
        torch.bfloat16,
        progress=False,
        mtp=args.mtp_tokens > 0,
        quant=args.quant,
        quant_lm_head=args.quant_lm_head,
    )
    if model.mtp is not None:
        model.set_draft_head(args.draft_head)
    if args.accept is not None:
        force_acceptance(args.accept, model.cfg.vocab_size)
    modes = {"off": [False], "on": [True], "both": [False, True, False]}[args.overlap]
    rows = [run_batch(model, int(b), args, o) for b in args.batches.split(",") for o in modes]
    if args.json:
        print(json.dumps({"args": vars(args), "rows": rows}))
        return 0
    print(
        f"context {args.context}, {args.threads} threads, quant {args.quant}"
        f"{' + int8 head' if args.quant_lm_head else ''}, mtp_tokens {args.mtp_tokens}, "
        f"accept {args.accept}, draft head {args.draft_head if args.mtp_tokens else '-'}"
    )
    print(
        "shares of the step: from cProfile (python / kernels / torch-C), then from timers around "
        "our kernels (outside them: torch's operators and Python)"
    )
    print(
        "batch  overlap  step ms  TPOT ms  tok/step  python  kernels  torch-C"
        "  | kernels  outside  acceptance"
    )
    for r in rows:
        print(
            f"{r['batch']:5d}  {'on' if r['overlap'] else 'off':>7}  {r['step_ms']:7.2f}"
            f"  {r['tpot_ms']:7.2f}  {r['tokens_per_step']:8.2f}"
            f"  {r['python_share']:6.1%}  {r['native_kernel_share']:7.1%}"
            f"  {r['torch_c_share']:7.1%}  | {r['timed_native_kernel_share']:7.1%}"
            f"  {r['timed_outside_kernels_share']:7.1%}"
            f"  {r.get('acceptance', float('nan')):.2f}"
        )
    for r in rows:
        if "main_ms" in r:
            print(
                f"batch {r['batch']}: main forward {r['main_ms']:.2f} ms, MTP draft "
                f"{r['draft_ms']:.2f} ms a step; routed experts read per MoE layer "
                f"{r['experts_per_moe_layer']:.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
