"""Smoke test of `bench/transfer.py` on tiny sizes: it runs, and reports consistent figures, on
plain sockets and over CURVE, and with the sender in a process of its own comparing plain and
sealed transfers in one run."""

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


def test_bench_transfer_two_processes_compares_modes(capsys):
    argv = ["--layers", "2", "--width", "8", "--prompt-len", "40", "--chunk-len", "16"]
    argv += ["--security", "off,aead", "--processes", "2"]
    assert transfer.main(argv + ["--requests", "3", "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["processes"] == 2 and set(result["modes"]) == {"off", "aead"}
    for mode in ("off", "aead"):
        assert result["modes"][mode]["bytes_per_run"] == 3 * 2 * 40 * 8 * 2
    off, aead = (result["modes"][m]["kv_bytes_per_s"] for m in ("off", "aead"))
    assert result["vs_first"] == {"off": 1.0, "aead": aead / off}
    assert result["kv_bytes_per_s"] == off  # the first mode's at the top level


def test_bench_transfer_refuses_unknown_modes(capsys):
    with pytest.raises(SystemExit):
        transfer.main(["--security", "off,rot13"])
    with pytest.raises(SystemExit):
        transfer.main(["--security", "curve", "--processes", "2"])
