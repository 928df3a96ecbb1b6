"""bench-serve against a fake streaming server whose delays, errors and token counts are known.

Oracles: the fake's own log (bodies received, the most requests in flight), its sleep times
(lower bounds on TTFT and TPOT), numpy recomputing every statistic from the raw records the
benchmark writes, and the PNG format itself for the plots.
"""

import json
import struct
import zlib

import numpy as np
import pytest
from bench_fakes import WORD, FakeBehavior, ServerThread, make_app
from fastapi.responses import PlainTextResponse

from bench import serve
from control.errors import DuetError
from control.tokenizer import Tokenizer
from deploy import cli
from tinymodel.make import ensure_tiny_model

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(ensure_tiny_model())


def run_bench(url, out, *extra):
    argv = ["--url", url, "--out", str(out), "--no-progress", "--seed", "3", *extra]
    args = serve.resolve(serve.build_parser().parse_args(argv))
    summary = serve.run(args)
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return summary, records


def check_png(path):
    """A well-formed PNG: signature, IHDR with a non-empty size, every chunk's CRC, IEND last."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    pos, kinds = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, payload = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + payload) == crc, f"bad CRC in {kind} of {path.name}"
        kinds.append(kind)
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100


def stats(values_s):
    arr = np.asarray(values_s) * 1e3
    return {"mean": arr.mean(), "median": np.median(arr), "p90": np.percentile(arr, 90),
            "p99": np.percentile(arr, 99)}  # fmt: skip


def test_all_counted_and_stats_match_records(tmp_path, tok, capsys):
    behavior = FakeBehavior(ttft_s=0.05, itl_s=0.01)
    app, state = make_app(behavior)
    with ServerThread(app) as server:
        argv = ["bench-serve", "--url", server.url, "--out", str(tmp_path), "--no-progress",
                "--num-prompts", "24", "--max-concurrency", "8", "--input-len", "19",
                "--output-len", "6", "--ttft-ms", "10000", "--tpot-ms", "10000"]  # fmt: skip
        assert cli.main(argv) == 0
    assert "Requests (completed / sent)" in capsys.readouterr().out
    summary = json.loads((tmp_path / "result.json").read_text())["summary"]
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]

    # Every request sent once, as asked, and counted once.
    assert len(state.received) == 24 and len(records) == 24
    assert sorted(r["index"] for r in records) == list(range(24))
    for body in state.received:
        assert len(tok.encode(body["prompt"])) == 19
        assert body["max_tokens"] == 6 and body["ignore_eos"] is True and body["stream"] is True
        assert body["model"] == "fake-model"
    assert state.max_in_flight <= 8
    assert summary["completed"] == 24 and summary["failed"] == 0 and summary["errors"] == {}
    assert all(r["ok"] and r["output_len"] == 6 and r["usage_reported"] for r in records)

    # Latencies are bounded below by the fake's sleeps.
    assert min(r["ttft_s"] for r in records) >= behavior.ttft_s
    assert all(len(r["itl_s"]) == 5 for r in records)
    assert np.median([r["tpot_s"] for r in records]) >= 0.8 * behavior.itl_s

    # Every statistic is the one numpy computes from the raw records.
    for key, field in (("ttft_ms", "ttft_s"), ("tpot_ms", "tpot_s"), ("e2e_ms", "latency_s")):
        expect = stats([r[field] for r in records])
        assert summary[key] == pytest.approx(expect, rel=1e-9), key
    expect = stats([g for r in records for g in r["itl_s"]])
    assert summary["itl_ms"] == pytest.approx(expect, rel=1e-9)
    duration = summary["duration_s"]
    assert duration >= max(r["start_s"] + r["latency_s"] for r in records)
    assert summary["request_throughput"] == pytest.approx(24 / duration)
    assert summary["output_throughput"] == pytest.approx(24 * 6 / duration)
    assert summary["input_throughput"] == pytest.approx(24 * 19 / duration)
    assert summary["sla_met"] == 24 and summary["goodput"] == pytest.approx(24 / duration)

    for name in ("latency_cdf.png", "timeline.png"):
        check_png(tmp_path / name)


def test_errors_counted_by_kind(tmp_path):
    app, state = make_app(
        FakeBehavior(ttft_s=0.01, itl_s=0.002, http_error_every=5, stream_error_every=7)
    )
    with ServerThread(app) as server:
        # TTFT SLA of 1 ms: the fake sleeps 10 ms, so no request can meet it.
        summary, records = run_bench(
            server.url,
            tmp_path,
            "--num-prompts",
            "20",
            "--input-len",
            "4",
            "--output-len",
            "5",
            "--ttft-ms",
            "1",
        )
    # Arrival k fails with 503 if k % 5 == 4 (4 of 20), else mid-stream if k % 7 == 6 (6, 13).
    assert len(state.received) == 20
    assert summary["errors"] == {"http_503": 4, "stream_error": 2}
    assert summary["completed"] == 14 and summary["failed"] == 6
    failed = [r for r in records if not r["ok"]]
    assert len(failed) == 6 and all(r["met_sla"] is False for r in failed)
    assert {r["error_message"] for r in failed if r["error"] == "http_503"} == {"overloaded (busy)"}
    assert summary["sla_met"] == 0 and summary["goodput"] == 0.0
    assert summary["rejected"] == 4 and summary["sla_attainment_admitted"] == 0.0
    # Statistics cover the completed requests only.
    ok = [r for r in records if r["ok"]]
    assert summary["ttft_ms"]["p99"] == pytest.approx(
        np.percentile([r["ttft_s"] * 1e3 for r in ok], 99)
    )
    check_png(tmp_path / "timeline.png")


def test_attainment_of_admitted_requests(tmp_path):
    """Requests refused with 503 count against attainment, not against that of the admitted."""
    app, _ = make_app(FakeBehavior(ttft_s=0.001, itl_s=0.001, http_error_every=4))
    with ServerThread(app) as server:
        summary, _ = run_bench(
            server.url,
            tmp_path,
            "--num-prompts",
            "20",
            "--input-len",
            "4",
            "--output-len",
            "3",
            "--ttft-ms",
            "5000",
            "--tpot-ms",
            "5000",
        )
    assert summary["rejected"] == 5 and summary["completed"] == 15 and summary["sla_met"] == 15
    assert summary["sla_attainment"] == pytest.approx(0.75)
    assert summary["sla_attainment_admitted"] == 1.0


def test_timeouts_and_unreachable_server(tmp_path, capsys):
    app, _ = make_app(FakeBehavior(ttft_s=2.0))
    with ServerThread(app) as server:
        summary, _ = run_bench(
            server.url,
            tmp_path,
            "--num-prompts",
            "2",
            "--input-len",
            "3",
            "--output-len",
            "2",
            "--timeout",
            "0.3",
            "--no-plots",
        )
    assert summary["errors"] == {"timeout": 2} and summary["completed"] == 0
    assert summary["ttft_ms"]["p99"] is None
    # A server that is not there: one clear line, exit code 1, no traceback.
    with pytest.raises(DuetError, match="cannot reach"):
        serve.main(["--url", server.url, "--out", str(tmp_path / "x"), "--no-progress"])
    assert cli.main(["bench-serve", "--url", server.url, "--out", str(tmp_path / "x")]) == 1
    assert capsys.readouterr().err.startswith("error: cannot reach")


def test_chat_without_usage_counts_tokens_with_tokenizer(tmp_path, tok):
    app, state = make_app(FakeBehavior(ttft_s=0.01, itl_s=0.002, usage=False))
    with ServerThread(app) as server:
        summary, records = run_bench(
            server.url,
            tmp_path,
            "--dataset",
            "synthetic-chat",
            "--num-prompts",
            "12",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--no-plots",
        )
    assert summary["completed"] == 12
    assert len(tok.encode(WORD * 3)) == 3  # the oracle: one token per streamed word
    by_len = sorted((r["prompt_len"], r["expected_output_len"]) for r in records)
    sent = sorted(
        (len(tok.encode(b["messages"][0]["content"])), b["max_tokens"]) for b in state.received
    )
    assert by_len == sent
    for r in records:
        assert not r["usage_reported"] and r["output_len"] == r["expected_output_len"]
    assert len({r["expected_output_len"] for r in records}) > 1  # the chat mix varies lengths


def test_poisson_arrivals(tmp_path):
    gaps = np.diff(serve.arrival_times(20000, 4.0, seed=1))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert np.std(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    assert np.all(serve.arrival_times(5, float("inf"), 0) == 0)
    app, _ = make_app(FakeBehavior(ttft_s=0.005, itl_s=0.001))
    with ServerThread(app) as server:
        _, records = run_bench(
            server.url,
            tmp_path,
            "--num-prompts",
            "8",
            "--request-rate",
            "40",
            "--input-len",
            "2",
            "--output-len",
            "2",
            "--no-plots",
        )
    planned = serve.arrival_times(8, 40.0, seed=3)
    for r in records:  # each request leaves no earlier than its planned arrival
        assert r["start_s"] >= planned[r["index"]] - 1e-6


def test_extra_body_reaches_every_request(tmp_path):
    app, state = make_app(FakeBehavior(ttft_s=0.0, itl_s=0.0))
    extra = {"repetition_penalty": 1.1, "min_p": 0.05, "presence_penalty": 0.5, "seed": 4}
    with ServerThread(app) as server:
        summary, _ = run_bench(
            server.url,
            tmp_path,
            "--num-prompts",
            "5",
            "--input-len",
            "4",
            "--output-len",
            "3",
            "--extra-body",
            json.dumps(extra),
        )
    assert summary["completed"] == 5 and len(state.received) == 5
    for body in state.received:
        assert {k: body[k] for k in extra} == extra and body["max_tokens"] == 3
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["args"]["extra_body"] == extra


@pytest.mark.parametrize(
    "raw,message",
    [("{", "not JSON"), ("[1]", "a JSON object"), ('{"stream": false}', "must not set stream")],
)
def test_bad_extra_body_is_a_one_line_error(raw, message):
    argv = ["--url", "http://x", "--extra-body", raw]
    with pytest.raises(DuetError, match=message):
        serve.resolve(serve.build_parser().parse_args(argv))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_multi_turn_sends_each_turn_with_its_whole_history(tmp_path, endpoint):
    """3 conversations x 3 turns: every turn carries the shared system prompt, the earlier user
    turns and the answers the server streamed to them, in order; a turn goes out only after the
    previous one's answer (its body comes later in the fake's log); records and summary tell
    turn 1 from the later ones."""
    app, state = make_app(FakeBehavior(ttft_s=0.0, itl_s=0.0))
    with ServerThread(app) as server:
        summary, records = run_bench(
            server.url,
            tmp_path,
            "--dataset", "multi-turn", "--endpoint", endpoint, "--num-prompts", "3",
            "--turns", "3", "--input-len", "5", "--output-len", "4", "--prefix-len", "6",
        )  # fmt: skip
    assert summary["completed"] == 9 and len(state.received) == 9
    assert sorted((r["conversation"], r["turn"]) for r in records) == [
        (c, t) for c in range(3) for t in (1, 2, 3)
    ]
    answer = WORD * 4  # what the fake streams for 4 tokens
    if endpoint == "chat":
        histories = [b["messages"] for b in state.received]
        systems = {h[0]["content"] for h in histories}
        assert len(systems) == 1 and len(next(iter(systems)).split()) == 6
        by_len = {n: [h for h in histories if len(h) == n] for n in (2, 4, 6)}
        assert all(len(v) == 3 for v in by_len.values())  # each conversation's three turns
        for later in by_len[4] + by_len[6]:
            assert [m["role"] for m in later] == ["system"] + ["user", "assistant"] * (
                len(later) // 2 - 1
            ) + ["user"]
            assert all(m["content"] == answer for m in later if m["role"] == "assistant")
            # the history is that of an earlier turn of the same conversation, sent before it
            earlier = histories.index(later[: len(later) - 2])
            assert earlier < histories.index(later)
    else:
        prompts = [b["prompt"] for b in state.received]
        for p in prompts:
            if p.count(answer):  # a later turn: an earlier turn's prompt, its answer, a new turn
                head = p[: p.rindex(answer) + len(answer)]
                earlier = head[: -len(answer)]
                assert earlier in prompts and prompts.index(earlier) < prompts.index(p)
        assert sorted(p.count(answer) for p in prompts) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert summary["ttft_ms_first_turn"]["median"] is not None
    assert summary["ttft_ms_later_turns"]["median"] is not None
    assert summary["kv_rows"] == {}  # not a duet router: no server counters, never zeros


def test_multi_turn_reports_the_kv_rows_a_duet_router_counted(tmp_path):
    """A server with duet's KV row counters in /metrics: the summary has their growth over the
    run (summed over the nodes), once it stopped moving, and the prompt tokens by turn."""
    app, state = make_app(FakeBehavior(ttft_s=0.0, itl_s=0.0))

    @app.get("/metrics")
    async def metrics():
        done = len(state.received)
        text = (
            f'duet_kv_rows_sent_total{{node="p0",role="prefill"}} {100 + 7 * done}\n'
            f'duet_kv_rows_sent_total{{node="p1",role="prefill"}} {3 * done}\n'
            f'duet_kv_rows_skipped_total{{node="p0",role="prefill"}} {5 * done}\n'
        )
        return PlainTextResponse(text)

    with ServerThread(app) as server:
        summary, _ = run_bench(
            server.url,
            tmp_path,
            "--dataset", "multi-turn", "--endpoint", "completions", "--num-prompts", "2",
            "--turns", "2", "--input-len", "5", "--output-len", "4", "--prefix-len", "6",
        )  # fmt: skip
    assert summary["kv_rows"] == {"kv_rows_sent": 40, "kv_rows_skipped": 20}  # 4 requests
    assert summary["prompt_tokens_first_turn"] > 0
    assert summary["prompt_tokens_later_turns"] > summary["prompt_tokens_first_turn"]
