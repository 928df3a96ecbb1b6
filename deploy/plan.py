"""`duet plan`: the xPyD layout, threads per role and decode batch that meet an SLA at a rate.

    duet plan --model DIR --sla-ttft-ms 1000 --sla-tpot-ms 50 --input-len 512 --output-len 128 \\
        --rate 2 [--hosts 1 --cores-per-host 16] [--profile FILE | --save-profile FILE] \\
        [--write-config cluster.toml]

1. Profile (`deploy.plan_profile`): prefill forwards by length and decode steps by batch size,
   at each candidate thread count, on this machine (or read a saved profile).
2. Fit each thread count's cost models (`control.cost_model`, plain least squares).
3. For every layout that fits the hosts (x prefill nodes of tp threads, y decode nodes of td
   threads, nodes packed first-fit onto hosts of C cores; the router's own core is not counted),
   simulate the cluster at the rate (`deploy.plan_model`) and predict the SLA attainment.
4. Recommend, among the layouts whose attainment reaches `--target`, the one with the highest
   goodput per core (ties: fewer cores); print the table behind the choice; write the cluster
   TOML on request. The decode batch cap is the largest batch whose predicted step meets the
   TPOT target (the decode node enforces the same cap at run time).
Quantization: bf16 is the only compute dtype until int8/fp8 kernels exist, so every row says bf16.
Exit status: 0 with a recommendation, 1 when no layout meets the target (the best is shown).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from control.cost_model import DecodeCost, PrefillCost
from control.errors import DuetError
from deploy.plan_model import DEFAULT_OVERHEAD_S, Layout, Prediction, Workload, simulate
from deploy.plan_profile import RoleProfile, profile_roles

FIT_PRIOR_WEIGHT = 1e-6  # the profile is the data: the fit must not lean on a CPU prior
TOP_ROWS = 12


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    prefill_threads: int
    decode_threads: int
    prediction: Prediction

    @property
    def cores(self) -> int:
        lay = self.layout
        return lay.num_prefill * self.prefill_threads + lay.num_decode * self.decode_threads

    def goodput_per_core(self, rate: float) -> float:
        return self.prediction.goodput(rate) / self.cores


def fit(profile: RoleProfile) -> dict[int, tuple[PrefillCost, DecodeCost]]:
    """Least-squares cost models per thread count (decay 1: every sample counts the same)."""
    fits = {}
    for threads, samples in profile.by_threads.items():
        prefill = PrefillCost(prior_weight=FIT_PRIOR_WEIGHT, decay=1.0)
        for new, prefix, seconds in samples.prefill:
            prefill.observe(int(new), int(prefix), seconds)
        decode = DecodeCost(prior_weight=FIT_PRIOR_WEIGHT, decay=1.0)
        for batch, context, seconds in samples.decode:
            decode.observe(int(batch), int(context), seconds)
        fits[threads] = (prefill, decode)
    return fits


def fits_hosts(sizes: list[int], hosts: int, cores_per_host: int) -> bool:
    """First-fit decreasing of nodes of `sizes` cores onto `hosts` hosts."""
    free = [cores_per_host] * hosts
    for size in sorted(sizes, reverse=True):
        host = next((h for h in range(hosts) if free[h] >= size), None)
        if host is None:
            return False
        free[host] -= size
    return True


def search(args, fits, workload: Workload) -> list[Candidate]:
    out = []
    mean_context = workload.input_len + workload.output_len / 2
    for tp, (prefill, _) in fits.items():
        for td, (_, decode) in fits.items():
            cap = decode.max_batch_within(workload.tpot_s, mean_context, args.max_batch)
            for x in range(1, args.max_prefill + 1):
                for y in range(1, args.max_decode + 1):
                    sizes = [tp] * x + [td] * y
                    if not fits_hosts(sizes, args.hosts, args.cores_per_host):
                        continue
                    layout = Layout(x, y, cap, args.chunk_size, args.max_batch_tokens)
                    prediction = simulate(
                        workload,
                        layout,
                        prefill,
                        decode,
                        args.overhead_ms / 1000,
                        args.num_requests,
                        args.seed,
                    )
                    out.append(Candidate(layout, tp, td, prediction))
    return out


def rank(candidates: list[Candidate], rate: float, target: float) -> list[Candidate]:
    """Layouts meeting the target first, by goodput per core then fewer cores; then the rest by
    attainment."""

    def key(c: Candidate):
        meets = c.prediction.attainment >= target
        if meets:
            return (0, -c.goodput_per_core(rate), c.cores)
        return (1, -c.prediction.attainment, c.cores)

    return sorted(candidates, key=key)


def table(ranked: list[Candidate], rate: float, target: float) -> str:
    head = (
        f"{'layout':>7} {'thr P/D':>7} {'cores':>5} {'quant':>5} {'batch':>5} {'P load':>6} "
        f"{'TTFT p50':>9} {'TPOT p50':>9} {'TTFT ok':>7} {'TPOT ok':>7} {'SLA ok':>6} "
        f"{'goodput':>8} {'/core':>6}"
    )
    lines = [head]
    for c in ranked[:TOP_ROWS]:
        p, lay = c.prediction, c.layout
        mark = "*" if p.attainment >= target else " "
        lines.append(
            f"{lay.num_prefill}P{lay.num_decode}D{mark:>2} {c.prefill_threads:>3}/{c.decode_threads:<3} "
            f"{c.cores:>5} {'bf16':>5} {lay.max_batch:>5} {p.prefill_load:>6.2f} "
            f"{_ms(p.median_ttft_s):>9} {_ms(p.median_tpot_s):>9} {p.p_ttft:>7.1%} "
            f"{p.p_tpot:>7.1%} {p.attainment:>6.1%} {p.goodput(rate):>8.2f} "
            f"{c.goodput_per_core(rate):>6.2f}"
        )
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds * 1000:.1f}ms"


def cluster_toml(best: Candidate, args, workload: Workload) -> str:
    """The recommendation as a cluster config. Ports: one block from `args.port`: HTTP, control,
    the prefill nodes' control ports, the decode nodes' control ports, their KV ports."""
    lay, port = best.layout, args.port
    tokens = lay.max_batch * (workload.input_len + workload.output_len)
    num_pages = max(4096, math.ceil(1.25 * tokens / args.page_size))
    model = "" if args.model_is_default else str(Path(args.model).resolve())
    decode_control = port + 2 + lay.num_prefill
    return f"""# Written by `duet plan` for input {workload.input_len} / output {workload.output_len} tokens at
# {workload.rate:g} requests/s: {lay.num_prefill}P{lay.num_decode}D, predicted SLA attainment {best.prediction.attainment:.1%}.
model = "{model}"
dtype = "bfloat16"

[sla]
ttft_ms = {args.sla_ttft_ms:g}
tpot_ms = {args.sla_tpot_ms:g}

[router]
host = "127.0.0.1"
port = {port}
control_port = {port + 1}

[[prefill]]
name = "prefill"
replicas = {lay.num_prefill}
control_port = {port + 2}
threads = {best.prefill_threads}
page_size = {args.page_size}
chunk_size = {lay.chunk_size}
max_batch_tokens = {lay.max_batch_tokens}

[[decode]]
name = "decode"
replicas = {lay.num_decode}
control_port = {decode_control}
kv_port = {decode_control + lay.num_decode}
threads = {best.decode_threads}
page_size = {args.page_size}
num_pages = {num_pages}
max_batch = {lay.max_batch}
"""


def ports_needed(layout: Layout) -> int:
    """The size of the written config's port block."""
    return 2 + layout.num_prefill + 2 * layout.num_decode


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="duet plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint dir (default: the built-in tiny model)")
    p.add_argument("--sla-ttft-ms", type=float, required=True)
    p.add_argument("--sla-tpot-ms", type=float, required=True)
    p.add_argument("--input-len", type=int, required=True)
    p.add_argument("--output-len", type=int, required=True)
    p.add_argument("--rate", type=float, required=True, help="requests/s (Poisson)")
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--cores-per-host", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--threads",
        default="",
        help="thread counts to try, e.g. 1,2 (default: 1, 2, 4, ... up to cores-per-host)",
    )
    p.add_argument("--target", type=float, default=0.9, help="SLA attainment to reach")
    p.add_argument("--max-prefill", type=int, default=8)
    p.add_argument("--max-decode", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=64, help="decode batch cap at most")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--max-batch-tokens", type=int, default=512, help="prefill forward budget")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--overhead-ms",
        type=float,
        default=DEFAULT_OVERHEAD_S * 1000,
        help="router + reservation + last KV chunk, added to each TTFT",
    )
    p.add_argument("--num-requests", type=int, default=1000, help="simulated requests a layout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per profiled shape")
    p.add_argument(
        "--colocated",
        action="store_true",
        help="profile each role while the "
        "other runs beside it (nodes sharing a host share its memory bandwidth)",
    )
    p.add_argument("--profile", help="read this saved profile instead of measuring")
    p.add_argument("--save-profile", help="write the measured profile here (JSON)")
    p.add_argument("--write-config", help="write the recommended cluster TOML here")
    p.add_argument("--port", type=int, default=8000, help="first port of the written TOML's block")
    args = p.parse_args(argv)
    for name in (
        "input_len",
        "output_len",
        "hosts",
        "cores_per_host",
        "max_prefill",
        "max_decode",
        "max_batch",
        "chunk_size",
        "max_batch_tokens",
        "page_size",
        "num_requests",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.rate <= 0 or args.sla_ttft_ms <= 0 or args.sla_tpot_ms <= 0:
        p.error("--rate, --sla-ttft-ms and --sla-tpot-ms must be positive")
    if not 0 < args.target <= 1:
        p.error("--target must be in (0, 1]")
    return args


def thread_counts(spec: str, cores_per_host: int) -> list[int]:
    if spec:
        try:
            counts = sorted({int(t) for t in spec.split(",") if t.strip()})
        except ValueError:
            raise DuetError(f"--threads {spec!r}: want comma-separated integers") from None
    else:
        powers = {2**k for k in range(cores_per_host.bit_length()) if 2**k < cores_per_host}
        counts = sorted(powers | {cores_per_host})
    if not counts or counts[0] < 1 or counts[-1] > cores_per_host:
        raise DuetError(f"--threads must be between 1 and --cores-per-host ({cores_per_host})")
    return counts


def main(argv: list[str] | None = None) -> int:
    from control.builtin_model import ensure_builtin_model

    args = parse_args(argv)
    args.model_is_default = not args.model
    args.model = args.model or str(ensure_builtin_model())
    workload = Workload(
        args.input_len, args.output_len, args.rate, args.sla_ttft_ms / 1000, args.sla_tpot_ms / 1000
    )
    if args.profile:
        profile = RoleProfile.load(args.profile)
        print(f"# profile {args.profile} (model {profile.model}, {profile.cpu_count} cpus)")
    else:
        counts = thread_counts(args.threads, args.cores_per_host)
        profile = profile_roles(
            args.model,
            counts,
            args.input_len,
            args.output_len,
            args.max_batch,
            args.chunk_size,
            args.page_size,
            args.repeats,
            colocated=args.colocated,
        )
        if args.save_profile:
            profile.save(args.save_profile)
            print(f"# wrote the profile to {args.save_profile}")
    fits = fit(profile)
    for threads, (prefill, decode) in sorted(fits.items()):
        a, b, c = prefill.model.weights
        da, db, dc = decode.model.weights
        print(
            f"# {threads} thread(s): prefill {a * 1e3:.2f} ms + {b * 1e6:.1f} us/token + "
            f"{c * 1e9:.2f} ns/(token x prefix); decode step {da * 1e3:.2f} ms + "
            f"{db * 1e6:.1f} us/request + {dc * 1e9:.2f} ns/context token"
        )
    ranked = rank(search(args, fits, workload), args.rate, args.target)
    if not ranked:
        raise DuetError("no layout fits the hosts (every node needs at least one core)")
    print(table(ranked, args.rate, args.target))
    best = ranked[0]
    if best.prediction.attainment < args.target:
        print(
            f"# no layout on {args.hosts} host(s) of {args.cores_per_host} cores reaches "
            f"{args.target:.0%} of requests within the SLA at {args.rate:g} requests/s; the best "
            f"reaches {best.prediction.attainment:.1%}",
            file=sys.stderr,
        )
        return 1
    lay = best.layout
    print(
        f"# recommended: {lay.num_prefill}P{lay.num_decode}D, prefill {best.prefill_threads} "
        f"thread(s), decode {best.decode_threads} thread(s), decode batch cap {lay.max_batch}, "
        f"bf16: predicted SLA attainment {best.prediction.attainment:.1%}, goodput "
        f"{best.prediction.goodput(args.rate):.2f} requests/s on {best.cores} cores"
    )
    if args.write_config:
        Path(args.write_config).write_text(cluster_toml(best, args, workload))
        print(f"# wrote {args.write_config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
