"""`duet bench-ttft`: the TTFT that disaggregation adds, against prefill alone on the same prompt.

1. Prefill alone: this process loads the model with the node's dtype and threads and times
   `OfflineGenerator.prefill` + sampling the first token (no sockets, no transfer).
2. Disaggregated: `duet up` (router + 1 prefill + 1 decode node) on the same model, threads and
   chunk size; the client's TTFT of a streamed completion of the same prompt token ids (HTTP,
   tokenization, reserve on D, prefill on P with the KV streamed to D, first token to client).
Prints both medians, the added ms and the ratio (target: added <= 10% of prefill alone).
The default model is a 1-layer DeepSeek-V2-Lite-shaped random checkpoint made in a temp dir.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="duet bench-ttft", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint dir (default: a 1-layer bench model in a temp dir)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="threads of each node, and of (1)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def prompt_ids(vocab_size: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(10, min(vocab_size, 30000), (length,), generator=gen).tolist()


def time_prefill_alone(model_dir: str, ids: list[int], args) -> list[float]:
    from control.sampling_params import SamplingParams
    from model.deepseek import DeepseekModel
    from native import ops
    from runtime.generate import OfflineGenerator
    from runtime.sampling import sample

    ops.set_num_threads(args.threads)
    model = DeepseekModel.from_pretrained(model_dir, torch.bfloat16, progress=False)
    gen = OfflineGenerator(model, page_size=16, chunk_size=args.chunk_size)
    greedy = SamplingParams(temperature=0.0)
    times = []
    for _ in range(args.repeats + 1):  # the first run warms up
        table = gen.pool.new_table()
        start = time.perf_counter()
        logits = gen.prefill(table, ids)
        sample(logits[None], [greedy], [None], [0])
        times.append(time.perf_counter() - start)
        gen.pool.release(table)
    del model, gen
    return times[1:]


def time_cluster_ttft(model_dir: str, ids: list[int], args) -> list[float]:
    cmd = [sys.executable, "-m", "deploy.cli", "up", "--model", model_dir, "--port", str(args.port)]
    cmd += ["--threads", str(args.threads), "--dtype", "bfloat16"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{args.port}"
    try:
        _wait_healthy(base, proc, timeout_s=600)
        name = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}
        times = []
        with httpx.Client(timeout=600) as client:
            for _ in range(args.repeats + 1):
                start = time.perf_counter()
                with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    lines = resp.iter_lines()
                    for line in lines:
                        if line.startswith("data: ") and '"text"' in line:
                            times.append(time.perf_counter() - start)
                            break
                    for _ in lines:  # drain to [DONE]
                        pass
        return times[1:]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: duet up exited with status {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("error: the cluster did not become healthy in time")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from tinymodel.bench_model import make_bench_model

            model_dir = str(make_bench_model(os.path.join(tmp, "bench-1layer"), layers=1))
        from control.model_config import ModelConfig

        ids = prompt_ids(ModelConfig.from_model_dir(model_dir).vocab_size, args.prompt_len)
        alone = statistics.median(time_prefill_alone(model_dir, ids, args))
        pd = statistics.median(time_cluster_ttft(model_dir, ids, args))
    result = {
        "prompt_len": args.prompt_len,
        "threads": args.threads,
        "prefill_alone_ms": alone * 1e3,
        "disaggregated_ttft_ms": pd * 1e3,
        "added_ms": (pd - alone) * 1e3,
        "added_ratio": (pd - alone) / alone,
        "load_average_1m": os.getloadavg()[0],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"prompt {args.prompt_len} tokens, {args.threads} thread(s) per node")
        print(f"  prefill alone (in process):       {result['prefill_alone_ms']:8.1f} ms")
        print(f"  TTFT through router + P + D:      {result['disaggregated_ttft_ms']:8.1f} ms")
        print(
            f"  added by disaggregation:          {result['added_ms']:8.1f} ms "
            f"({100 * result['added_ratio']:.1f}%, target <= 10%)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
