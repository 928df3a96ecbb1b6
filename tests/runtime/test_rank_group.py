"""The decode ranks' group listens on the node's address only: two real ranks (processes) join a
RankGroup on 127.0.0.2, an address that is neither the wildcard torch's store binds by itself
nor 127.0.0.1, where gloo goes when the hostname resolves there, and every socket each rank
listens on is on 127.0.0.2. A `bind_host` this machine does not have is a ConfigError that
names bind_host; a node binding every interface whose `host` is not this machine's meets on
127.0.0.1. Loopback only: no traffic leaves the machine."""

import json
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from listeners import listening_sockets

from control.cluster_config import DecodeNodeConfig
from control.errors import ConfigError
from runtime.rank_group import RankGroup, rendezvous_listener

HOST = "127.0.0.2"


def _rank_main(rank: int, out_dir: str):
    cfg = DecodeNodeConfig(name="d", host="localhost", bind_host=HOST, ranks=2)
    port_file = Path(out_dir) / "port"
    if rank == 0:
        rendezvous = rendezvous_listener(cfg)
        port_file.write_text(str(rendezvous.getsockname()[1]))
    else:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline, "rank 0 never wrote its port"
            time.sleep(0.05)
        rendezvous = (HOST, int(port_file.read_text()))
    group = RankGroup(rank, 2, rendezvous, timeout_s=30)
    try:
        rows = group.all_gather([rank, 10 + rank])
        plan = group.broadcast_bytes(b"plan" if rank == 0 else None)
        listening = sorted(listening_sockets())
        group.all_gather([0])  # both ranks looked before either closes
        result = {"rows": rows, "plan": plan.decode(), "listening": listening}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        group.close()


def test_both_ranks_listen_on_the_node_address_only(tmp_path):
    mp.spawn(_rank_main, args=(str(tmp_path),), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["rows"] == [[0, 10], [1, 11]] and result["plan"] == "plan"
        assert result["listening"], f"rank {rank} listens on nothing"
        assert {addr for addr, _ in result["listening"]} == {HOST}, result["listening"]
    assert len(results[0]["listening"]) >= 2  # the store and gloo's own listener


def test_a_bind_host_of_another_machine_is_a_config_error():
    cfg = DecodeNodeConfig(name="d", host="localhost", bind_host="203.0.113.9", ranks=2)
    with pytest.raises(ConfigError, match="node d: the ranks cannot listen on 203.0.113.9"):
        rendezvous_listener(cfg)


def test_a_wildcard_node_whose_host_is_elsewhere_meets_on_loopback():
    cfg = DecodeNodeConfig(name="d", host="203.0.113.9", bind_host="0.0.0.0", ranks=2)
    with rendezvous_listener(cfg) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"
