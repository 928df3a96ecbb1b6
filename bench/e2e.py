"""`duet bench-e2e`: offline end to end, per quantization: load time, memory, TTFT, TPOT, accuracy.

Each quantization of `--quant` runs in a fresh subprocess (`bench/e2e_worker.py`), one after the
other, so each load's peak memory is its own and no two share the cores:
- load s: `model.pack_cache.load_model` (bf16; `quant=` for int8 / fp8 / int4; a `Q@pack` row
  maps its weights from a pack);
- weights: bytes of every tensor storage reachable from the model (packed weights included, each
  storage once, RoPE tables not counted); resident: RssAnon + RssFile right after the load
  (after a gc); peak: VmHWM read then, i.e. the load's peak; base: RSS before the load;
- TTFT: `--batch` random prompts of `--prompt-len` tokens prefilled together (one extend forward
  per chunk of `--chunk-size` tokens of each prompt) plus the greedy first tokens; TPOT: the
  median of `--decode-steps` decode steps of the batch, greedy tokens fed back. Medians over
  `--repeats` after one warm-up;
- timing, by default (`--no-interleave`: each worker's own): all the quantizations loaded in one
  more process and timed in interleaved rounds (`bench/e2e_timing.py`), TTFT and TPOT the
  medians over the rounds, the ratios the medians of each round's ratios;
- accuracy: next-token log-probs teacher-forced over `--kl-tokens` held-out tokens; the parent
  reports KL(none || q) = mean over positions of sum_v p_none (log p_none - log p_q) and the
  share of positions whose argmax agrees, against the first "none" row (added if missing).
Ratios are against that "none" row of the same run (or the `--reference` row).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

import torch

from control.quant_schemes import QUANT_SCHEMES

QUANTS = QUANT_SCHEMES  # none, int8, fp8, int4 (model.quant)
# "Q/A": scheme Q with the attention projections in A (`quant_attention`); "Q+head": with the
# LM head in int8 (`quant_lm_head`); "Q@pack": mapped from a packed weight store (--pack, else
# the weights cache's); in that order, e.g. "int4/int4+head@pack"
_SCHEMES = (*QUANTS, *(f"{q}/{a}" for q in QUANTS for a in QUANTS))
_HEADS = (*_SCHEMES, *(f"{q}+head" for q in _SCHEMES))
ROWS = (*_HEADS, *(f"{q}@pack" for q in _HEADS))
GB = 1e9


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="duet bench-e2e", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint dir (default: the built-in tiny model)")
    p.add_argument(
        "--quant",
        default="none",
        help=f"comma list of {', '.join(QUANTS)}; Q/A: with the attention projections in A "
        "(quant_attention); Q+head: with the LM head in int8 (quant_lm_head); Q@pack maps Q's "
        "weights from a pack (--pack, else the weights cache's, built once), e.g. "
        "int8,int4,int4/int4,int8+head,int8@pack",
    )
    p.add_argument("--pack", help="the pack the @pack row maps (made by duet pack)")
    p.add_argument(
        "--reference",
        default="none",
        help="the row the ratios and the KL compare against (default none, added if missing; "
        "another must be listed: e.g. int8 for int8@pack, or int8@pack where bf16 does not fit)",
    )
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed runs (medians), after a warm-up")
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: all)")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kl-tokens", type=int, default=256, help="held-out tokens; 0 = no accuracy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker-timeout", type=float, default=3600.0, help="seconds per quant")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument(
        "--no-interleave", action="store_true", help="time each quant in its own worker only"
    )
    p.add_argument("--worker", choices=(*ROWS, "timing"), help=argparse.SUPPRESS)
    p.add_argument("--timing-quants", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    return p, p.parse_args(argv)


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The quant list (with "none" first if it was missing); p.error on a bad value."""
    from control.model_config import ModelConfig

    quants = [q.strip() for q in args.quant.split(",") if q.strip()]
    bad = [q for q in quants if q not in ROWS]
    if not quants or bad:
        p.error(
            f"--quant: expected a comma list of {', '.join(QUANTS)}, each optionally followed by "
            f"/A (A one of them), +head and @pack, got {args.quant!r}"
        )
    if args.pack and len({q for q in quants if q.endswith("@pack")}) != 1:
        p.error("--pack holds one scheme: name exactly one Q@pack row")
    for name in ("prompt_len", "batch", "decode_steps", "repeats", "chunk_size", "page_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.kl_tokens < 0 or (args.threads is not None and args.threads <= 0):
        p.error("--kl-tokens must be >= 0 and --threads positive")
    max_pos = ModelConfig.from_model_dir(args.model).max_position_embeddings
    if args.prompt_len + args.decode_steps > max_pos or args.kl_tokens > max_pos:
        p.error(
            f"--prompt-len + --decode-steps ({args.prompt_len + args.decode_steps}) and "
            f"--kl-tokens ({args.kl_tokens}) must fit the model's context ({max_pos})"
        )
    if args.reference not in quants:
        if args.reference != "none":
            p.error(f"--reference {args.reference} is not one of the --quant rows")
        quants = ["none", *quants]
    return quants


def kl_and_agreement(ref_logp: torch.Tensor, q_logp: torch.Tensor) -> tuple[float, float]:
    """Log-probs [N, V] of the reference and of q -> (mean KL(ref || q) in nats, share of the
    N positions where the argmax agrees)."""
    p = ref_logp.exp()
    terms = torch.where(p > 0, p * (ref_logp - q_logp), torch.zeros_like(p))
    agree = (ref_logp.argmax(-1) == q_logp.argmax(-1)).double().mean()
    return terms.sum(-1).mean().item(), agree.item()


def run_worker(args, quant: str, prefix: Path, extra: tuple[str, ...] = ()) -> dict:
    """One quant (or "timing": every quant, interleaved) in a fresh `python -m bench.e2e
    --worker` (this checkout first on the path)."""
    root = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.getenv("PYTHONPATH")])),
    }
    cmd = [sys.executable, "-m", "bench.e2e", "--worker", quant, "--worker-out", str(prefix)]
    cmd += ["--model", args.model, "--seed", str(args.seed)]
    for name in ("prompt_len", "batch", "decode_steps", "repeats", "chunk_size", "page_size"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cmd += ["--kl-tokens", str(args.kl_tokens)]
    if args.pack:
        cmd += ["--pack", args.pack]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    cmd += list(extra)
    try:
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=args.worker_timeout
        )
    except subprocess.TimeoutExpired:
        return {
            "quant": quant,
            "error": f"worker ran past --worker-timeout {args.worker_timeout} s",
        }
    result = prefix.with_suffix(".json")
    if result.is_file():
        return json.loads(result.read_text())
    tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return {"quant": quant, "error": f"worker died: {tail}"}


def apply_interleaved(rows: list[dict], timing: dict, reference: str = "none") -> None:
    """Each row's TTFT / TPOT from the interleaved rounds (medians), and its ratios to the
    `reference` row as the medians of the rounds' own ratios (`add_comparisons` keeps them)."""
    ref = timing.get(reference)
    for row in rows:
        t = timing.get(row["quant"])
        if "error" in row or t is None:
            continue
        row["ttft_s"], row["tpot_s"] = median(t["ttft_s"]), median(t["tpot_s"])
        row["rounds"] = len(t["ttft_s"])
        if ref is not None:
            pairs = zip(ref["ttft_s"], t["ttft_s"], strict=True)
            row["prefill_speedup"] = median([a / b for a, b in pairs])
            pairs = zip(t["tpot_s"], ref["tpot_s"], strict=True)
            row["tpot_ratio"] = median([a / b for a, b in pairs])


def add_comparisons(rows: list[dict], reference: str = "none") -> None:
    """KL / agreement and ratios of each row against the first `reference` row that succeeded."""
    ref = next((r for r in rows if r["quant"] == reference and "error" not in r), None)
    if ref is None:
        return
    ref_lp = torch.load(ref["logprobs_file"], weights_only=True) if "logprobs_file" in ref else None
    for row in rows:
        if "error" in row:
            continue
        row.setdefault("prefill_speedup", ref["ttft_s"] / row["ttft_s"])
        row.setdefault("tpot_ratio", row["tpot_s"] / ref["tpot_s"])
        for key in ("weights", "resident", "peak"):
            row[f"{key}_ratio"] = row[f"{key}_bytes"] / ref[f"{key}_bytes"]
        if row is not ref and ref_lp is not None and "logprobs_file" in row:
            lp = torch.load(row["logprobs_file"], weights_only=True)
            if not torch.equal(lp["ids"], ref_lp["ids"]):
                raise RuntimeError("the workers' held-out tokens differ (not deterministic?)")
            row["kl"], row["top1_agreement"] = kl_and_agreement(ref_lp["logprobs"], lp["logprobs"])


def _fmt(row: dict, key: str, scale: float = 1.0, spec: str = ".3f") -> str:
    return format(row[key] * scale, spec) if key in row else "-"


def print_table(rows: list[dict]) -> None:
    """Aligned columns for the rows that ran, then one line per row that failed."""
    head = ["quant", "load s", "weights GB", "base GB", "resident GB (anon+file)", "peak GB"]
    head += ["TTFT ms", "TPOT ms", "KL", "top-1", "prefill x", "TPOT /", "resident /", "peak /"]
    lines = [head]
    for r in rows:
        if "error" in r:
            continue
        anon, file = r["rss_anon_bytes"] / GB, r["rss_file_bytes"] / GB
        lines.append(
            [r["quant"], _fmt(r, "load_s", spec=".2f"), _fmt(r, "weights_bytes", 1 / GB)]
            + [_fmt(r, "base_rss_bytes", 1 / GB), f"{anon + file:.3f} ({anon:.3f}+{file:.3f})"]
            + [_fmt(r, "peak_bytes", 1 / GB), _fmt(r, "ttft_s", 1e3, ".1f")]
            + [_fmt(r, "tpot_s", 1e3, ".2f"), _fmt(r, "kl", spec=".2e")]
            + [_fmt(r, "top1_agreement"), _fmt(r, "prefill_speedup", spec=".2f")]
            + [_fmt(r, k, spec=".2f") for k in ("tpot_ratio", "resident_ratio", "peak_ratio")]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))
    for r in rows:
        if "error" in r:
            print(f"{r['quant']}: error: {r['error']}")


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    if args.worker == "timing":
        from bench.e2e_timing import run

        return run(args)
    if args.worker:
        from bench.e2e_worker import run

        return run(args)
    from tinymodel.make import ensure_tiny_model

    args.model = args.model or str(ensure_tiny_model())
    quants = check_args(p, args)
    with tempfile.TemporaryDirectory(prefix="duet-bench-e2e-") as tmp:
        rows = [run_worker(args, q, Path(tmp) / f"row{i}") for i, q in enumerate(quants)]
        ran = [r["quant"] for r in rows if "error" not in r]  # a row that failed is not timed
        if ran and not args.no_interleave:
            timing = run_worker(
                args, "timing", Path(tmp) / "timing", ("--timing-quants", ",".join(ran))
            )
            if "error" in timing:
                rows.append({"quant": "timing", "error": timing["error"]})
            else:
                apply_interleaved(rows, timing, args.reference)
        add_comparisons(rows, args.reference)
    for row in rows:
        row.pop("logprobs_file", None)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(
            f"# {args.model}: prompt {args.prompt_len} x batch {args.batch}, {args.decode_steps} "
            f"decode steps, chunk {args.chunk_size}, threads {args.threads or 'all'}, medians of "
            f"{args.repeats}{'' if args.no_interleave else ' interleaved rounds'}; KL over "
            f"{args.kl_tokens} tokens and ratios vs the first {args.reference} row"
        )
        print_table(rows)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
