"""A router that is replica 1 of two (`[router] replicas = 2`), over fake nodes: it binds
replica 1's ports, marks every wire id it sends with its replica (forks and later attempts
too), pings with its replica, and shows clients their ids as they are."""

import dataclasses

import httpx
import pytest
from router_fakes import RecordingCluster, RouterServer, fake_config, stop_all

from control.protocol import Prefill, Reserve
from control.router_links import replica_of
from deploy.local_cluster import free_port_run


@pytest.fixture(scope="module")
def replica1(model_dir, tok):
    cfg = fake_config()
    router = dataclasses.replace(
        cfg.router, control_port=free_port_run(2), port=free_port_run(2), replicas=2
    )
    cfg = dataclasses.replace(cfg, router=router)
    started = []
    fakes = RecordingCluster(cfg, tok.encode(" one two three"), tok.eos_token_ids[0])
    fakes.router_replica = 1
    fakes.start()
    server = RouterServer(cfg, model_dir, replica=1)
    started.append((fakes, server))
    server.start()
    yield cfg, fakes, server
    stop_all(started)


def test_replica_one_binds_its_own_ports(replica1):
    cfg, _, server = replica1
    assert server.url.endswith(f":{cfg.router.port + 1}")
    view = httpx.get(server.url + "/v1/cluster", timeout=5).json()["router"]
    assert view["replica"] == 1 and view["replicas"] == 2
    assert view["control_endpoint"].endswith(f":{cfg.router.control_port + 1}")


def test_wire_ids_and_pings_name_replica_one(replica1):
    _, fakes, server = replica1
    body = {"model": "tiny-model", "prompt": "hi", "max_tokens": 3, "n": 2, "temperature": 1.0}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
    assert reply.status_code == 200, reply.text
    client_id = reply.json()["id"]
    assert client_id.startswith("cmpl-") and replica_of(client_id) == 0  # shown as it is
    (reserve,) = [m for m in fakes.sent(Reserve) if m.request_id.endswith(client_id)]
    assert reserve.request_id == "r1." + client_id
    assert [replica_of(f) for f in reserve.fork_ids] == [1]
    (prefill,) = [m for m in fakes.sent(Prefill) if m.request_id == reserve.request_id]
    assert prefill.seq >= 1
    pings = list(fakes.pings)
    assert pings and {p.replica for p in pings} == {1}
    assert len({p.router_id for p in pings}) == 1
