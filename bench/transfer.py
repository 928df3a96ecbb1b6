"""KV transfer throughput: our sender/receiver vs raw ZeroMQ PUSH/PULL, same bytes, same run.

Both move `requests` prompts of `prompt_len` tokens in `chunk_len`-token chunks of
[layers, chunk_len, width] rows over loopback TCP. Ours adds what a real transfer needs: a
validated msgpack header, checksum on both ends, the handshake, and the copy into a paged KVPool
(decode page size `decode_page_size`) with completeness checks; raw only moves the frames.
Reported: bytes/s of each (best of `repeats`) and their ratio (target >= 0.7); with several
`--security` modes, each mode's, measured interleaved, and its ratio to the first.
`--processes 2` runs our sender in a process of its own, as a prefill node is: its passes over
the bytes (checksum or seal) then run beside the receiver's instead of taking turns with them
on one interpreter's lock (neither XXH3 nor `cryptography`'s AES-GCM releases it).

    python -m bench.transfer [--prompt-len 2048 --chunk-len 256 --requests 8 --json]
    python -m bench.transfer --security off,aead --processes 2
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import msgpack
import torch
import zmq

from control.security import CurveKeys, CurveSecurity
from kvtransfer import Rendezvous, ZmqReceiver, ZmqSender, make_fingerprint
from kvtransfer.sealing import new_key
from model.kv_pool import KVPool

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SECURITY_MODES = ("off", "curve", "aead")
TIMEOUT = 60.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="duet bench-transfer", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=27, help="DeepSeek-V2-Lite: 27")
    p.add_argument("--width", type=int, default=576, help="row width: kv_lora_rank + rope dim")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--chunk-len", type=int, default=256)
    p.add_argument("--requests", type=int, default=8, help="prompts moved per measurement")
    p.add_argument("--inflight", type=int, default=2, help="requests the decode pool can hold")
    p.add_argument("--decode-page-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="measurements of each; best is kept")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--security",
        default="off",
        help="off, curve or aead, or several comma-separated (measured interleaved in one run, "
        "each compared with the first). curve: both transfers over CURVE sockets (a fresh "
        "cluster key), as a cluster with kv_security = curve moves its KV; aead: ours on plain "
        "sockets with every message sealed by AES-256-GCM under a key per request "
        "(kv_security = aead), raw plain",
    )
    p.add_argument(
        "--processes",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: our sender runs in a process of its own, as the prefill node does (plain and "
        "aead only); 1: both ends share this interpreter",
    )
    args = p.parse_args(argv)
    args.modes = args.security.split(",")
    if not args.modes or any(m not in SECURITY_MODES for m in args.modes):
        p.error(f"--security: each of {', '.join(SECURITY_MODES)}, got {args.security!r}")
    if args.processes == 2 and "curve" in args.modes:
        p.error("--processes 2 measures plain and aead transfers (not curve)")
    positive = ("layers", "width", "prompt_len", "chunk_len", "requests", "inflight", "repeats")
    for name in (*positive, "decode_page_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def make_chunks(args: argparse.Namespace) -> list[tuple[int, torch.Tensor]]:
    """(token_start, rows [L, T, W]) for one prompt; every request sends the same rows."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(args.layers, args.prompt_len, args.width, generator=gen)
    rows = rows.to(DTYPES[args.dtype])
    return [
        (t, rows[:, t : t + args.chunk_len].contiguous())
        for t in range(0, args.prompt_len, args.chunk_len)
    ]


def _decode_side(args: argparse.Namespace) -> tuple[dict, KVPool, int]:
    """The receiving node's fingerprint, its KV pool (room for `inflight` prompts) and the pages
    a prompt takes."""
    dtype = DTYPES[args.dtype]
    fp = make_fingerprint({"bench": "transfer"}, args.layers, args.width, dtype)
    pages_per_request = -(-args.prompt_len // args.decode_page_size)
    pool = KVPool(
        args.layers, pages_per_request * args.inflight, args.decode_page_size, args.width, dtype
    )
    return fp, pool, pages_per_request


def _send_prompt(sender: ZmqSender, args: argparse.Namespace, chunks, i: int, key) -> None:
    """Request `i`'s rows and its done, as a prefill node streams them."""
    rdv = Rendezvous(f"bench-{i}", i)
    for token_start, rows in chunks:
        sender.send_chunk(rdv, 0, token_start, rows, key)
    sender.send_done(rdv, args.prompt_len, 1, key=key)


def _move_all(args, pool: KVPool, pages_per_request: int, receiver: ZmqReceiver, send) -> dict:
    """Every request as the decode node takes it: room reserved when the pool has it, the KV
    expected (under a fresh key with aead), then `send(i, key)` has it sent. Seconds until all
    are in, and the bytes written."""
    tables, num_ready = {}, 0

    def handle(events):
        nonlocal num_ready
        for event in events:
            if not event.is_ready:
                raise RuntimeError(f"transfer failed: {event.reason}")
            pool.release(tables.pop(event.rendezvous))
            num_ready += 1

    start = time.perf_counter()
    for i in range(args.requests):
        while pool.allocator.num_free < pages_per_request:  # decode admission: wait for room
            handle(receiver.poll(TIMEOUT) or _fail("no transfer finished in time"))
        rdv = Rendezvous(f"bench-{i}", i)
        tables[rdv] = table = pool.new_table()
        pool.reserve(table, args.prompt_len)
        key = new_key() if args.security == "aead" else None  # one per transfer
        receiver.expect(rdv, table, args.prompt_len, time.monotonic() + TIMEOUT, key)
        send(i, key)
    while num_ready < args.requests:
        handle(receiver.poll(TIMEOUT) or _fail("no transfer finished in time"))
    seconds = time.perf_counter() - start
    stats = receiver.stats()
    if stats.num_dropped:
        raise RuntimeError(f"receiver dropped chunks: {stats.dropped}")
    return {"seconds": seconds, "bytes": stats.bytes_written}


def run_ours(args: argparse.Namespace, chunks) -> dict:
    """Seconds to move all requests through ZmqSender -> ZmqReceiver -> KVPool."""
    fp, pool, pages_per_request = _decode_side(args)
    # One context (one zmq I/O thread) per side, as in two processes.
    recv_ctx, send_ctx = zmq.Context(), zmq.Context()
    security = _security(args)
    receiver = ZmqReceiver(pool, fp, context=recv_ctx, security=security)
    sender = ZmqSender("bench", context=send_ctx, security=security)
    try:
        sender.connect(receiver.endpoint, fp, TIMEOUT)
        return _move_all(
            args,
            pool,
            pages_per_request,
            receiver,
            lambda i, key: _send_prompt(sender, args, chunks, i, key),
        )
    finally:
        sender.close(timeout=TIMEOUT)
        receiver.close(timeout=TIMEOUT)
        if not (receiver._thread.is_alive() or (sender._thread and sender._thread.is_alive())):
            if security is not None:
                security.release(recv_ctx)  # its ZAP handler's socket, before term
            send_ctx.term()  # would wait for a socket still open: only once both threads ended
            recv_ctx.term()


def _sender_process(args: argparse.Namespace, endpoint: str, fp, orders) -> None:
    """The sending node of `--processes 2`: its own interpreter, as a prefill node is. Sends
    each request `orders` names ((index, key)), then says it is done."""
    chunks = make_chunks(args)
    send_ctx = zmq.Context()
    sender = ZmqSender("bench", context=send_ctx)
    try:
        sender.connect(endpoint, fp, TIMEOUT)
        orders.send_bytes(b"connected")
        while order := orders.recv_bytes():  # msgpack [index, key or None]; b"" ends
            _send_prompt(sender, args, chunks, *msgpack.unpackb(order))
    finally:
        sender.close(timeout=TIMEOUT)
        send_ctx.term()


def run_ours_two_processes(args: argparse.Namespace, chunks) -> dict:
    """`run_ours` with the sender in a process of its own (a prefill node's), the receiver and
    its pool here (a decode node's): the two ends' passes over the bytes (checksums, seals)
    run side by side, as between two nodes, instead of taking turns on one interpreter.
    (`chunks` are made again in the sender.)"""
    import multiprocessing

    fp, pool, pages_per_request = _decode_side(args)
    recv_ctx = zmq.Context()
    receiver = ZmqReceiver(pool, fp, context=recv_ctx)
    spawn = multiprocessing.get_context("spawn")
    orders, theirs = spawn.Pipe()
    child = spawn.Process(target=_sender_process, args=(args, receiver.endpoint, fp, theirs))
    child.start()
    try:
        if not orders.poll(TIMEOUT) or orders.recv_bytes() != b"connected":
            raise RuntimeError("the sending process did not connect")
        return _move_all(
            args,
            pool,
            pages_per_request,
            receiver,
            lambda i, key: orders.send_bytes(msgpack.packb([i, key])),
        )
    finally:
        orders.send_bytes(b"")
        child.join(TIMEOUT)
        if child.is_alive():
            child.kill()
        receiver.close(timeout=TIMEOUT)
        if not receiver._thread.is_alive():
            recv_ctx.term()


def run_raw(args: argparse.Namespace, chunks) -> dict:
    """Seconds to move the same frames ([small header, payload]) over PUSH -> PULL."""
    recv_ctx, send_ctx = zmq.Context(), zmq.Context()
    pull, push = recv_ctx.socket(zmq.PULL), send_ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 0)
    security = _security(args)
    if security is not None:
        security.server(pull)
        security.client(push)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    payloads = [rows.view(torch.uint8).reshape(-1).numpy() for _, rows in chunks]
    header = b"\0" * 96  # about the size of our msgpack chunk header
    num_messages = args.requests * len(payloads)
    received = {"bytes": 0}

    def receive():
        for _ in range(num_messages):
            if not pull.poll(int(TIMEOUT * 1000)):
                return
            frames = pull.recv_multipart(copy=False)
            received["bytes"] += len(frames[1])

    try:
        thread = threading.Thread(target=receive)
        start = time.perf_counter()
        thread.start()
        for _ in range(args.requests):
            for payload in payloads:
                push.send_multipart([header, payload], copy=False)
        thread.join(TIMEOUT)
        seconds = time.perf_counter() - start
        if (
            thread.is_alive()
            or received["bytes"] != sum(p.nbytes for p in payloads) * args.requests
        ):
            raise RuntimeError("raw zmq transfer did not complete")
        return {"seconds": seconds, "bytes": received["bytes"]}
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        if security is not None:
            security.release(recv_ctx)
        send_ctx.term()
        recv_ctx.term()


def _security(args: argparse.Namespace) -> CurveSecurity | None:
    """A fresh cluster key's CurveSecurity with `--security curve`, else None (plain sockets:
    off, and aead, whose messages are sealed instead)."""
    if args.security != "curve":
        return None
    public, secret = zmq.curve_keypair()
    return CurveSecurity(CurveKeys(public, secret))


def _fail(msg: str):
    raise RuntimeError(msg)


def measure(args: argparse.Namespace, chunks) -> dict[str, dict]:
    """Per security mode: ours and raw, best of `repeats`, the modes interleaved in each round
    so that machine noise hits them alike."""
    run = run_ours_two_processes if args.processes == 2 else run_ours
    as_mode = {m: argparse.Namespace(**{**vars(args), "security": m}) for m in args.modes}
    for mode_args in as_mode.values():  # warm-up
        run(argparse.Namespace(**{**vars(mode_args), "requests": 1}), chunks)
    runs = {m: {"ours": [], "raw": []} for m in args.modes}
    for _ in range(args.repeats):
        for mode, mode_args in as_mode.items():
            runs[mode]["raw"].append(run_raw(mode_args, chunks))
            runs[mode]["ours"].append(run(mode_args, chunks))
    out = {}
    for mode, r in runs.items():
        best_ours = min(r["ours"], key=lambda x: x["seconds"])
        best_raw = min(r["raw"], key=lambda x: x["seconds"])
        ours_bps = best_ours["bytes"] / best_ours["seconds"]
        raw_bps = best_raw["bytes"] / best_raw["seconds"]
        out[mode] = {
            "bytes_per_run": best_ours["bytes"],
            "kv_bytes_per_s": ours_bps,
            "raw_zmq_bytes_per_s": raw_bps,
            "ratio": ours_bps / raw_bps,
            "all_kv_seconds": [x["seconds"] for x in r["ours"]],
            "all_raw_seconds": [x["seconds"] for x in r["raw"]],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chunks = make_chunks(args)
    by_mode = measure(args, chunks)
    first = by_mode[args.modes[0]]
    result = {
        "layers": args.layers,
        "width": args.width,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "chunk_len": args.chunk_len,
        "chunk_bytes": chunks[0][1].numel() * chunks[0][1].element_size(),
        "requests": args.requests,
        "decode_page_size": args.decode_page_size,
        "processes": args.processes,
        "security": args.security,
        **first,  # the first mode's figures at the top level
        "target_ratio": 0.7,
        # Ours does ~3 more passes over the bytes (2 checksum, 1 copy) on other threads: on a
        # machine with few idle cores the ratio says more about the load than the code.
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
    }
    if len(args.modes) > 1:
        result["modes"] = by_mode
        result["vs_first"] = {
            m: r["kv_bytes_per_s"] / first["kv_bytes_per_s"] for m, r in by_mode.items()
        }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"KV rows {args.layers}x{args.width} {args.dtype}, {args.requests} prompts of "
        f"{args.prompt_len} tokens in {args.chunk_len}-token chunks "
        f"({result['chunk_bytes'] / 1e6:.1f} MB each), decode page {args.decode_page_size}, "
        f"sender in {'its own process' if args.processes == 2 else 'this process'}"
    )
    for mode, r in by_mode.items():
        print(f"  security {mode}:")
        print(f"    kvtransfer (zmq, checksum, into KVPool): {r['kv_bytes_per_s'] / 1e9:6.2f} GB/s")
        print(
            f"    raw zmq PUSH/PULL, same frames:       {r['raw_zmq_bytes_per_s'] / 1e9:6.2f} GB/s"
        )
        print(f"    ratio: {r['ratio']:.2f} (target >= 0.7)")
        if mode != args.modes[0]:
            vs = r["kv_bytes_per_s"] / first["kv_bytes_per_s"]
            print(f"    {vs:.2f}x of security {args.modes[0]}")
    print(f"  ({os.cpu_count()} CPUs, 1-minute load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
