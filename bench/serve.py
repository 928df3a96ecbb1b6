"""`duet bench-serve`: load generator for any OpenAI-compatible streaming server.

Sends `--num-prompts` streaming requests to `/v1/completions` (or `/v1/chat/completions`) with
Poisson arrivals at `--request-rate` (inf: all at once) and/or at most `--max-concurrency` in
flight, prompts of controlled token length (bench.datasets), fixed output lengths
(`ignore_eos`). Per request it records TTFT (send -> first chunk with text), inter-token
latencies (gaps between text chunks), end-to-end latency and TPOT = (latency - TTFT) /
(output tokens - 1); output tokens come from the stream's final `usage` when the server sends it,
else from tokenizing the streamed text. A failed request is recorded with its error kind, never
raised. The summary (bench.serve_metrics) is printed as a table and written with the raw records:

    OUT/result.json      arguments + summary
    OUT/requests.jsonl   one record per request (the summary is computed from exactly these)
    OUT/latency_cdf.png  OUT/timeline.png

    duet bench-serve --url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4 \\
        --input-len 512 --output-len 128 [--config deploy/configs/1p1d.toml] [--out DIR]

`--dataset multi-turn --turns T`: `--num-prompts` conversations of T turns, each turn sent when
the previous answer arrived, with the whole history (bench.multi_turn); the summary adds the
TTFT of first turns and of later ones.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench import server_counters
from bench.datasets import DATASETS, DEFAULT_PREFIX_LEN, BenchRequest, make_requests
from bench.serve_metrics import RequestRecord, format_table, summarize
from control.errors import ConfigError, DuetError

CONNECT_TIMEOUT_S = 10.0


# ---- one request --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
    """Where and how requests are sent."""

    url: str  # base URL, e.g. http://127.0.0.1:8000
    chat: bool
    model: str | None
    ignore_eos: bool
    temperature: float
    timeout_s: float
    extra_body: dict[str, Any] = dataclasses.field(default_factory=dict)  # merged into each body

    @property
    def endpoint(self) -> str:
        return self.url + ("/v1/chat/completions" if self.chat else "/v1/completions")

    def payload(self, req: BenchRequest, prompt: dict[str, Any] | None = None) -> dict[str, Any]:
        """The request body; `prompt`: the fields that carry the prompt instead of `req.prompt`
        (a multi-turn history: `messages`, or a `prompt` text)."""
        body: dict[str, Any] = {
            "max_tokens": req.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if prompt is not None:
            body.update(prompt)
        elif self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.model is not None:
            body["model"] = self.model
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM / SGLang / duet extension: exact output length
        return {**body, **self.extra_body}


class _Failed(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def _chunk_text(obj: dict[str, Any], chat: bool) -> str:
    choices = obj.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def _stream(
    client: httpx.AsyncClient, target: Target, req: BenchRequest, rec, tokenizer, prompt, parts
):
    """Send one request and fill `rec` from its SSE stream, the streamed text into `parts`;
    raises _Failed."""
    t_send = time.perf_counter()
    last = None
    usage = None
    body = target.payload(req, prompt)
    async with client.stream("POST", target.endpoint, json=body) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode("utf-8", "replace")
            raise _Failed(f"http_{resp.status_code}", _error_message(body))
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, event names
            data = line[5:].strip()
            if data == "[DONE]":
                rec.latency_s = time.perf_counter() - t_send
                done = True
                break
            try:
                obj = json.loads(data)
            except ValueError:
                raise _Failed(
                    "bad_response", f"a stream chunk is not JSON: {data[:80]!r}"
                ) from None
            if obj.get("error"):
                raise _Failed("stream_error", _error_message(json.dumps(obj)))
            usage = obj.get("usage") or usage
            text = _chunk_text(obj, target.chat)
            if not text:
                continue
            now = time.perf_counter()
            if last is None:
                rec.ttft_s = now - t_send
            else:
                rec.itl_s.append(now - last)
            last = now
            parts.append(text)
        if not done:
            raise _Failed("incomplete_stream", "the stream ended without [DONE]")
    if last is None:
        raise _Failed("no_output", "the stream carried no text")
    rec.usage_reported = usage is not None and "completion_tokens" in usage
    if rec.usage_reported:
        rec.output_len = int(usage["completion_tokens"])
        rec.prompt_len = int(usage.get("prompt_tokens", rec.prompt_len))
    else:
        rec.output_len = len(tokenizer.encode("".join(parts)))
    if rec.output_len > 1:
        rec.tpot_s = (rec.latency_s - rec.ttft_s) / (rec.output_len - 1)
    rec.ok = True


def _error_message(body: str) -> str:
    """The one-line message of an OpenAI error body, else the body's start."""
    try:
        err = json.loads(body).get("error", {})
        message = err.get("message") or ""
        code = err.get("code")
        return f"{message} ({code})" if code else message
    except (ValueError, AttributeError):
        return body.strip().splitlines()[0][:200] if body.strip() else ""


async def send_one(
    client,
    target: Target,
    index: int,
    req: BenchRequest,
    t0: float,
    tokenizer,
    prompt: dict[str, Any] | None = None,
    text_out: list[str] | None = None,
):
    """One request's RequestRecord; every failure is recorded as an error kind, never raised.
    `prompt`: the body's prompt fields (`Target.payload`); `text_out` gets the streamed text."""
    rec = RequestRecord(
        index=index,
        start_s=time.perf_counter() - t0,
        prompt_len=req.prompt_len,
        expected_output_len=req.output_len,
    )
    try:
        parts = [] if text_out is None else text_out
        stream = _stream(client, target, req, rec, tokenizer, prompt, parts)
        await asyncio.wait_for(stream, target.timeout_s)
    except _Failed as exc:
        rec.error, rec.error_message = exc.kind, exc.message
    except (asyncio.TimeoutError, httpx.TimeoutException):
        rec.error, rec.error_message = "timeout", f"no answer within {target.timeout_s:g} s"
    except httpx.ConnectError as exc:
        rec.error, rec.error_message = "connect_error", str(exc)
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        rec.error, rec.error_message = "connection_lost", str(exc) or type(exc).__name__
    except httpx.HTTPError as exc:
        rec.error, rec.error_message = "transport_error", f"{type(exc).__name__}: {exc}"
    if rec.error is not None:
        rec.ok = False
    return rec


# ---- the run ------------------------------------------------------------------------------------
def arrival_times(n: int, rate: float, seed: int) -> np.ndarray:
    """Send offsets (s) of `n` requests: a Poisson process of `rate`/s from 0; all 0 if inf."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


async def run_requests(
    target: Target,
    requests: list[BenchRequest],
    rate: float,
    max_concurrency: int | None,
    seed: int,
    tokenizer,
    progress: bool | None = None,
    arrivals: np.ndarray | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every request on schedule (`arrivals`, else Poisson at `rate`); returns (records
    in request order, duration in s)."""
    from tqdm import tqdm

    if arrivals is None:
        arrivals = arrival_times(len(requests), rate, seed)
    limit = max_concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    timeout = httpx.Timeout(target.timeout_s, connect=min(CONNECT_TIMEOUT_S, target.timeout_s))
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    bar = tqdm(
        total=len(requests),
        desc="requests",
        unit="req",
        disable=None if progress is None else not progress,
    )
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                rec = await send_one(client, target, i, requests[i], t0, tokenizer)
            bar.update(1)
            return rec

        with bar:
            records = await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - t0
    return list(records), duration


async def _model_name(url: str) -> str | None:
    """The first model id of GET /v1/models; DuetError when the server cannot be reached."""
    try:
        async with httpx.AsyncClient(timeout=CONNECT_TIMEOUT_S, trust_env=False) as client:
            resp = await client.get(url + "/v1/models")
    except httpx.HTTPError as exc:
        raise DuetError(f"cannot reach {url} ({type(exc).__name__}: {exc})") from None
    try:
        return str(resp.json()["data"][0]["id"]) if resp.status_code == 200 else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


# ---- command line -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duet bench-serve", description=__doc__.splitlines()[0])
    p.add_argument("--url", help="server base URL (default: the router of --config)")
    p.add_argument("--config", help="cluster config: SLA defaults, URL, model (tokenizer)")
    p.add_argument(
        "--tokenizer",
        help="model dir whose tokenizer makes prompts (default: the "
        "config's model, else the built-in tiny model)",
    )
    p.add_argument("--model", help="the request's `model` field (default: GET /v1/models)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson (inf)")
    p.add_argument(
        "--load-steps",
        metavar="RATE:SECONDS,...",
        help="a stepped load instead of one rate (e.g. 2:45,8:45,2:45): Poisson arrivals at "
        "each rate for its seconds (their count replaces --num-prompts); the summary adds each "
        "step's SLA attainment and the node-seconds the cluster spent (bench.stepped_load)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--dataset", choices=(*DATASETS, "multi-turn"), default="random")
    p.add_argument(
        "--turns", type=int, default=4, help="multi-turn: turns per conversation (--num-prompts)"
    )
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens (chat: median)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (chat: median)")
    p.add_argument(
        "--prefix-len",
        type=int,
        default=DEFAULT_PREFIX_LEN,
        help="shared-prefix / multi-turn: tokens of the prefix every prompt starts with",
    )
    p.add_argument(
        "--endpoint",
        choices=("auto", "completions", "chat"),
        default="auto",
        help="auto: completions for random, chat for the others",
    )
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly --output-len tokens (a vLLM/SGLang extension)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--extra-body",
        default="{}",
        metavar="JSON",
        help="a JSON object merged into every request body, e.g. sampling options: "
        '\'{"repetition_penalty": 1.1, "min_p": 0.05}\'',
    )
    p.add_argument("--ttft-ms", type=float, help="SLA on TTFT (default: the config's, else 1000)")
    p.add_argument("--tpot-ms", type=float, help="SLA on TPOT (default: the config's, else 50)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output folder (default: bench-results/serve-<time>)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--label", default="", help="a name for this run, kept in result.json")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill defaults that depend on --config; validate. Raises ConfigError on bad input."""
    from control.cluster_config import ClusterConfig, SlaConfig

    cfg = ClusterConfig.load(args.config) if args.config else None
    sla = cfg.sla if cfg else SlaConfig()
    args.ttft_ms = sla.ttft_ms if args.ttft_ms is None else args.ttft_ms
    args.tpot_ms = sla.tpot_ms if args.tpot_ms is None else args.tpot_ms
    if args.url is None:
        if cfg is None:
            raise ConfigError("give --url or --config")
        args.url = f"http://{cfg.router.host}:{cfg.router.port}"
    args.url = args.url.rstrip("/").removesuffix("/v1")
    if args.tokenizer is None and cfg is not None and cfg.model:
        args.tokenizer = cfg.model
    for name in ("num_prompts", "input_len", "output_len", "turns"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if not args.request_rate > 0:
        raise ConfigError("--request-rate must be > 0 (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError("--max-concurrency must be >= 1")
    if args.timeout <= 0 or args.ttft_ms <= 0 or args.tpot_ms <= 0:
        raise ConfigError("--timeout, --ttft-ms and --tpot-ms must be positive")
    if args.load_steps is not None:
        from bench.stepped_load import parse_steps, stepped_arrivals

        if args.dataset == "multi-turn":
            raise ConfigError(
                "--load-steps: not with the multi-turn dataset (turns wait on answers)"
            )
        args.load_steps = parse_steps(args.load_steps)
        args.num_prompts = len(stepped_arrivals(args.load_steps, args.seed))
        if args.num_prompts < 1:
            raise ConfigError("--load-steps: no request arrives in those steps")
    if args.endpoint == "auto":
        args.endpoint = "completions" if args.dataset == "random" else "chat"
    args.extra_body = parse_extra_body(args.extra_body)
    if args.out is None:
        args.out = str(Path("bench-results") / time.strftime("serve-%Y%m%d-%H%M%S"))
    return args


# What the benchmark itself sets to measure what it measures: not for --extra-body.
OWN_FIELDS = ("prompt", "messages", "max_tokens", "stream", "stream_options", "model")


def parse_extra_body(raw: str | dict[str, Any]) -> dict[str, Any]:
    """--extra-body's JSON object (ConfigError for anything else, or for a field the benchmark
    sets itself)."""
    if isinstance(raw, dict):  # already parsed (a sweep's resolved arguments)
        return raw
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ConfigError("--extra-body must be a JSON object")
    own = sorted(set(body) & set(OWN_FIELDS))
    if own:
        raise ConfigError(f"--extra-body must not set {', '.join(own)} (the benchmark sets it)")
    return body


def load_tokenizer(model_dir: str | None):
    from control.builtin_model import ensure_builtin_model
    from control.tokenizer import Tokenizer

    return Tokenizer(model_dir or ensure_builtin_model())


def run(args: argparse.Namespace, tokenizer=None) -> dict[str, Any]:
    """Run one benchmark from resolved arguments; write OUT; return the summary."""
    tokenizer = tokenizer or load_tokenizer(args.tokenizer)
    if args.dataset == "multi-turn":
        return _run_multi_turn(args, tokenizer)
    requests = make_requests(
        tokenizer,
        args.dataset,
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.seed,
        args.prefix_len,
    )
    target = _target(args)
    progress = False if args.no_progress else None
    if args.load_steps is not None:
        return _run_stepped(args, target, requests, tokenizer, progress)
    records, duration = asyncio.run(
        run_requests(
            target,
            requests,
            args.request_rate,
            args.max_concurrency,
            args.seed,
            tokenizer,
            progress,
        )
    )
    summary = summarize(records, duration, args.ttft_ms, args.tpot_ms)
    write_outputs(Path(args.out), args, summary, records)
    return summary


def _run_stepped(args, target: Target, requests, tokenizer, progress) -> dict[str, Any]:
    from bench.stepped_load import NodeWatcher, by_step, stepped_arrivals

    arrivals = stepped_arrivals(args.load_steps, args.seed)
    with NodeWatcher(args.url + "/metrics") as nodes:
        records, duration = asyncio.run(
            run_requests(
                target,
                requests,
                math.inf,
                args.max_concurrency,
                args.seed,
                tokenizer,
                progress,
                arrivals=arrivals,
            )
        )
    summary = summarize(records, duration, args.ttft_ms, args.tpot_ms)
    summary["load_steps"] = by_step(records, args.load_steps, args.ttft_ms, args.tpot_ms, arrivals)
    summary["nodes"] = nodes.summary()
    write_outputs(Path(args.out), args, summary, records)
    return summary


def _target(args: argparse.Namespace) -> Target:
    model = args.model or asyncio.run(_model_name(args.url))
    return Target(
        args.url,
        args.endpoint == "chat",
        model,
        args.ignore_eos,
        args.temperature,
        args.timeout,
        args.extra_body,
    )


def _run_multi_turn(args: argparse.Namespace, tokenizer) -> dict[str, Any]:
    from bench.multi_turn import make_conversations, run_conversations

    conversations = make_conversations(
        tokenizer,
        args.num_prompts,
        args.turns,
        args.input_len,
        args.output_len,
        args.prefix_len,
        args.seed,
    )
    target = _target(args)
    before = server_counters.settled(args.url)  # what earlier runs moved, fully reported
    records, duration = asyncio.run(
        run_conversations(
            target,
            conversations,
            args.request_rate,
            args.max_concurrency,
            args.seed,
            tokenizer,
            send_one,
            arrival_times,
        )
    )
    summary = summarize(records, duration, args.ttft_ms, args.tpot_ms)
    summary["kv_rows"] = server_counters.moved(before, server_counters.settled(args.url))
    write_outputs(Path(args.out), args, summary, records)
    return summary


def write_outputs(out: Path, args, summary: dict[str, Any], records: list[RequestRecord]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    arg_dict = {
        k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
    }
    result = {"args": arg_dict, "summary": summary}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    with open(out / "requests.jsonl", "w") as f:
        for rec in records:
            met = rec.met_sla(args.ttft_ms, args.tpot_ms)
            f.write(json.dumps({**dataclasses.asdict(rec), "met_sla": met}) + "\n")
    if not args.no_plots:
        from bench.plots import plot_latency_cdfs, plot_timeline

        plot_latency_cdfs(records, out / "latency_cdf.png", args.ttft_ms, args.tpot_ms)
        plot_timeline(records, out / "timeline.png", args.ttft_ms, args.tpot_ms)


def main(argv: list[str] | None = None) -> int:
    args = resolve(build_parser().parse_args(argv))
    summary = run(args)
    load = f"rate {args.request_rate:g}/s"
    if args.load_steps is not None:
        load = "steps " + ", ".join(f"{r:g}/s x {t:g} s" for r, t in args.load_steps)
    title = (
        f"Serving benchmark: {args.url} ({args.dataset}, {load}, "
        f"concurrency {args.max_concurrency or 'unlimited'})"
    )
    print(format_table(summary, title))
    for step in summary.get("load_steps", []):
        print(
            f"step {step['rate']:g}/s for {step['seconds']:g} s: {step['requests']} requests, "
            f"{step['completed']} completed, SLA attainment {step['sla_attainment']:.1%}, "
            f"p99 TTFT {step['ttft_ms']['p99'] or 0:.0f} ms"
        )
    if "nodes" in summary:
        nodes = summary["nodes"]
        print(f"node-seconds {nodes['node_seconds']:.1f} (peak {nodes['peak_nodes']:g} nodes)")
    print(f"results: {args.out}")
    return 0
