"""Smoke test of `bench/transfer.py` on tiny sizes: it runs, and reports consistent figures, on
plain sockets and over CURVE."""

import json

import pytest

from bench import transfer


@pytest.mark.parametrize("security", ["off", "curve"])
def test_bench_transfer_json(capsys, security):
    argv = ["--layers", "2", "--width", "8", "--prompt-len", "40", "--chunk-len", "16"]
    argv += ["--security", security]
    assert transfer.main(argv + ["--requests", "3", "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["security"] == security
    assert result["bytes_per_run"] == 3 * 2 * 40 * 8 * 2
    assert result["ratio"] == result["kv_bytes_per_s"] / result["raw_zmq_bytes_per_s"]
    assert result["kv_bytes_per_s"] > 0 and result["raw_zmq_bytes_per_s"] > 0
