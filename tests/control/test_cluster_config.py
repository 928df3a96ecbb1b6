"""Cluster config addresses: `host` (what peers connect to, advertised in every endpoint) and
`bind_host` (what the sockets bind, default `host`), and the errors for addresses that cannot
work (a wildcard peers would connect to, IPv6, a URL)."""

from pathlib import Path

import pytest

from control.cluster_config import ClusterConfig
from control.errors import ConfigError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _cfg(router=None, prefill=None, decode=None) -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "router": router or {},
            "prefill": [{"name": "p", **(prefill or {})}],
            "decode": [{"name": "d", **(decode or {})}],
        }
    )


def test_without_bind_host_every_socket_binds_host():
    cfg = _cfg(
        {"host": "10.1.0.1", "control_port": 7000},
        {"host": "10.1.0.2", "control_port": 7100},
        {"host": "10.1.0.3", "control_port": 7200, "kv_port": 7300},
    )
    r, p, d = cfg.router, cfg.prefill[0], cfg.decode[0]
    assert r.listen_host == r.host == "10.1.0.1"
    assert r.control_endpoint == r.control_bind_endpoint == "tcp://10.1.0.1:7000"
    assert p.control_endpoint == p.control_bind_endpoint == "tcp://10.1.0.2:7100"
    assert d.kv_endpoint == d.kv_bind_endpoint == "tcp://10.1.0.3:7300"
    assert d.group_host == "10.1.0.3"


def test_a_wildcard_bind_still_advertises_host():
    wild = {"bind_host": "0.0.0.0"}
    cfg = _cfg(
        {"host": "10.1.0.1", **wild},
        {"host": "10.1.0.2", **wild},
        {"host": "10.1.0.3", "ranks": 2, **wild},
    )
    r, p, d = cfg.router, cfg.prefill[0], cfg.decode[0]
    assert r.listen_host == "0.0.0.0" and r.binds_every_interface
    assert r.control_endpoint == "tcp://10.1.0.1:7000"  # what the nodes connect to
    assert r.control_bind_endpoint == "tcp://0.0.0.0:7000"
    assert p.control_endpoint == "tcp://10.1.0.2:7100"
    assert p.control_bind_endpoint == "tcp://0.0.0.0:7100"
    assert d.kv_endpoint == "tcp://10.1.0.3:7300"  # in NodeReady and ReserveReply
    assert d.kv_bind_endpoint == "tcp://0.0.0.0:7300"
    assert d.group_host == "10.1.0.3"  # the ranks' group: the node's address, not every one


def test_a_specific_bind_host_is_where_the_ranks_listen_too():
    d = _cfg(decode={"host": "203.0.113.5", "bind_host": "10.1.0.3", "ranks": 2}).decode[0]
    assert d.kv_endpoint == "tcp://203.0.113.5:7300"  # behind NAT: peers use the public one
    assert d.kv_bind_endpoint == "tcp://10.1.0.3:7300"
    assert d.group_host == "10.1.0.3" and not d.binds_every_interface


def test_replicas_keep_host_and_bind_host():
    raw = {
        "prefill": [{"name": "p", "host": "10.1.0.2", "bind_host": "0.0.0.0", "replicas": 2}],
        "decode": [{"name": "d"}],
    }
    nodes = ClusterConfig.from_dict(raw).prefill
    assert [n.control_bind_endpoint for n in nodes] == ["tcp://0.0.0.0:7100", "tcp://0.0.0.0:7101"]
    assert [n.control_endpoint for n in nodes] == ["tcp://10.1.0.2:7100", "tcp://10.1.0.2:7101"]


@pytest.mark.parametrize("name", ["1p1d.toml", "2p1d.toml"])
def test_shipped_configs_stay_on_loopback(name):
    cfg = ClusterConfig.load(DEPLOY / "configs" / name)
    for role in (cfg.router, *cfg.prefill, *cfg.decode):
        assert role.host == role.listen_host == "127.0.0.1"


@pytest.mark.parametrize(
    "router, prefill, decode, match",
    [
        (
            {"host": "0.0.0.0"},
            {},
            {},
            r'\[router\]: host = .0\.0\.0\.0. .*bind_host = "0\.0\.0\.0"',
        ),
        ({}, {"host": "0.0.0.0"}, {}, "node p: host = '0.0.0.0' is the address the other roles"),
        ({}, {}, {"host": "0.0.0.0", "bind_host": "0.0.0.0"}, "node d: host = '0.0.0.0'"),
        ({"host": "::1"}, {}, {}, r"\[router\]: host must be a host name or an IPv4 address"),
        ({}, {"bind_host": "::"}, {}, r"node p: bind_host must be .*\(no scheme, port or IPv6"),
        ({}, {}, {"host": "tcp://10.0.0.3:7300"}, "node d: host must be a host name"),
        ({}, {}, {"host": ""}, "node d: host must be a host name"),
        ({"bind_host": "*"}, {}, {}, r'\[router\]: bind_host .*"0\.0\.0\.0" binds every'),
        ({}, {"bind_host": 7}, {}, r"\[prefill.p\] bind_host must be str"),
    ],
)
def test_addresses_that_cannot_work_are_refused(router, prefill, decode, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(router, prefill, decode)


def test_prefix_cache_settings_default_on_and_are_checked():
    cfg = _cfg()
    assert cfg.prefill[0].prefix_cache is True and cfg.router.cache_balance_tokens == 2048
    off = _cfg(router={"cache_balance_tokens": 0}, prefill={"prefix_cache": False})
    assert off.prefill[0].prefix_cache is False and off.router.cache_balance_tokens == 0
    with pytest.raises(ConfigError, match=r"\[router\] cache_balance_tokens must be >= 0"):
        _cfg(router={"cache_balance_tokens": -1})
    with pytest.raises(ConfigError, match=r"\[prefill.p\] prefix_cache must be bool"):
        _cfg(prefill={"prefix_cache": "yes"})


@pytest.mark.parametrize(
    "sla, match",
    [
        ({"admission": "drop"}, "admission must be one of"),
        ({"queue_s": 0}, "queue_s must be positive"),
        ({"kv_bytes_per_s": -1.0}, "kv_bytes_per_s must be positive"),
        ({"cap_decode_batch": "yes"}, "cap_decode_batch must be bool"),
    ],
)
def test_bad_sla_admission_fields_are_config_errors_naming_the_field(sla, match):
    raw = {"prefill": [{"name": "p"}], "decode": [{"name": "d"}], "sla": sla}
    with pytest.raises(ConfigError, match=match):
        ClusterConfig.from_dict(raw)


def test_the_reasoning_and_tool_parsers_are_off_by_default_and_checked():
    assert _cfg().router.reasoning_parser == ""
    assert _cfg(router={"reasoning_parser": "deepseek_r1"}).router.reasoning_parser == "deepseek_r1"
    with pytest.raises(
        ConfigError, match=r"\[router\] reasoning_parser must be one of deepseek_r1"
    ):
        _cfg(router={"reasoning_parser": "r1"})
    assert _cfg(router={"tool_parser": "deepseek_v3"}).router.tool_parser == "deepseek_v3"
    with pytest.raises(ConfigError, match=r"\[router\] tool_parser must be one of hermes"):
        _cfg(router={"tool_parser": "json"})


def test_sla_admission_defaults_keep_todays_behaviour():
    cfg = ClusterConfig.from_dict({"prefill": [{"name": "p"}], "decode": [{"name": "d"}]})
    assert cfg.sla.admission == "none" and cfg.sla.queue_s == 5.0 and cfg.sla.cap_decode_batch
    cfg = ClusterConfig.from_dict(
        {
            "prefill": [{"name": "p"}],
            "decode": [{"name": "d"}],
            "sla": {"admission": "queue", "queue_s": 2},
        }
    )
    assert cfg.sla.admission == "queue" and cfg.sla.queue_s == 2.0


def test_mtp_settings_default_off_and_are_checked():
    """MTP: off by default; every decode node must agree (the MTP layer's cache is
    part of the KV every prefill node sends), mtp_tokens within what kv_done carries; with
    expert-parallel ranks too (the MTP layer's experts are sharded like the others)."""
    cfg = _cfg()
    assert not cfg.uses_mtp and cfg.decode[0].mtp_tokens == 1
    cfg = _cfg(decode={"mtp": True, "mtp_tokens": 3})
    assert cfg.uses_mtp and cfg.decode[0].mtp_tokens == 3
    two = {"prefill": [{"name": "p"}], "router": {}}
    decode = [{"name": "d0", "mtp": True}, {"name": "d1", "kv_port": 7301, "control_port": 7201}]
    with pytest.raises(ConfigError, match="node d1: mtp must be the same on every decode node"):
        ClusterConfig.from_dict({**two, "decode": decode})
    for bad in (0, 17):
        with pytest.raises(ConfigError, match="mtp_tokens must be in"):
            _cfg(decode={"mtp": True, "mtp_tokens": bad})
    cfg = _cfg(decode={"mtp": True, "ranks": 2})
    assert cfg.uses_mtp and cfg.decode[0].ranks == 2
    with pytest.raises(ConfigError, match="mtp must be bool"):
        _cfg(decode={"mtp": "yes"})


def test_prefill_ranks_default_to_one_and_their_settings_are_checked():
    """Tensor-parallel prefill: one rank, "tp" over the shared-memory all-reduce and
    automatic placement by default; what is not built (the MTP layer under "tp_sp") or cannot
    work is refused, naming the node and the key."""
    p = _cfg().prefill[0]
    assert (p.ranks, p.parallel, p.all_reduce, p.pin, p.rank_cpus) == (1, "tp", "shm", "auto", ())
    p = _cfg(prefill={"ranks": 2, "all_reduce": "gloo", "rank_cpus": ["0", "1-3"]}).prefill[0]
    assert (p.ranks, p.all_reduce, p.rank_cpus) == (2, "gloo", ("0", "1-3"))
    assert _cfg(prefill={"ranks": 2, "parallel": "tp_sp"}).prefill[0].parallel == "tp_sp"
    for prefill, match in (
        ({"ranks": 0}, "node p: ranks must be >= 1"),
        ({"parallel": "pp"}, "node p: parallel must be one of tp, tp_sp, got 'pp'"),
        ({"all_reduce": "nccl"}, "node p: all_reduce must be one of shm, gloo"),
        ({"pin": "numa"}, "node p: pin must be one of auto, off"),
        ({"ranks": 2, "rank_cpus": ["0"]}, "rank_cpus names 1 core sets for 2 ranks"),
        ({"rank_cpus": ["0-x"]}, "node p: rank_cpus: '0-x' is not a cpu list"),
        ({"rank_cpus": "0"}, "rank_cpus must be a list of strings"),
    ):
        with pytest.raises(ConfigError, match=match):
            _cfg(prefill=prefill)
    with pytest.raises(ConfigError, match='node p: parallel = "tp_sp" cannot run the MTP layer'):
        _cfg(prefill={"ranks": 2, "parallel": "tp_sp"}, decode={"mtp": True})
    assert _cfg(prefill={"ranks": 2}, decode={"mtp": True}).prefill[0].ranks == 2  # "tp" runs it


def test_ranks_on_other_hosts_need_gloo_a_group_port_and_one_host_a_rank():
    ok = {"ranks": 3, "rank_hosts": ["10.0.0.5", "10.0.0.6"], "all_reduce": "gloo",
          "group_port": 7150}  # fmt: skip
    p = _cfg(prefill={"host": "10.0.0.4", **ok}).prefill[0]
    assert p.hosts_of_ranks == ("10.0.0.4", "10.0.0.5", "10.0.0.6")
    assert _cfg(prefill={"host": "10.0.0.4", "ranks": 2}).prefill[0].hosts_of_ranks == (
        "10.0.0.4",
        "10.0.0.4",
    )
    for change, match in (
        ({"rank_hosts": ["10.0.0.5"]}, "rank_hosts names 1 hosts for ranks 1..2"),
        ({"all_reduce": "shm"}, 'need all_reduce = "gloo" and a group_port'),
        ({"group_port": 0}, 'need all_reduce = "gloo" and a group_port'),
        ({"rank_hosts": ["0.0.0.0", "10.0.0.6"]}, "nor may it be a wildcard"),
        ({"rank_hosts": ["tcp://a", "10.0.0.6"]}, "'tcp://a' is not a host name"),
        ({"group_port": 70000}, r"group_port must be in \[0, 65535\]"),
        ({"group_port": 7100}, "two sockets of the cluster share a host:port"),  # control's
    ):
        with pytest.raises(ConfigError, match=match):
            _cfg(prefill={**ok, **change})
    with pytest.raises(ConfigError, match="list each replica as its own entry"):
        _cfg(prefill={**ok, "replicas": 2})
    # Replicas shift a fixed group_port like every port; a free one (0) stays free.
    raw = {"router": {}, "decode": [{"name": "d"}]}
    two = ClusterConfig.from_dict({**raw, "prefill": [{"name": "p", "replicas": 2, "ranks": 2}]})
    assert [n.group_port for n in two.prefill] == [0, 0]
    two = ClusterConfig.from_dict(
        {**raw, "prefill": [{"name": "p", "replicas": 2, "ranks": 2, "group_port": 7150}]}
    )
    assert [n.group_port for n in two.prefill] == [7150, 7151]


def test_quant_attention_is_unset_by_default_and_checked():
    """`quant_attention` ("" = the node's `quant`'s own scheme) takes the scheme names; a bad
    name, a non-string, or any scheme but "none" on a float32 cluster is one line naming the node
    and the key."""
    default = _cfg(prefill={"quant": "int4"})
    assert default.prefill[0].quant_attention == "" and default.decode[0].quant_attention == ""
    for scheme in ("none", "int8", "fp8", "int4"):
        cfg = _cfg(prefill={"quant": "int4", "quant_attention": scheme})
        assert cfg.prefill[0].quant_attention == scheme
    assert _cfg(decode={"quant_attention": "int8"}).decode[0].quant_attention == "int8"

    def refused(match, dtype="bfloat16", **node):
        raw = {"dtype": dtype, "prefill": [{"name": "p"}], "decode": [{"name": "d", **node}]}
        with pytest.raises(ConfigError, match=match) as err:
            ClusterConfig.from_dict(raw)
        assert "\n" not in str(err.value)

    bad_name = "node d: quant_attention must be one of none, int8, fp8, int4, got 'int5'"
    refused(bad_name, quant_attention="int5")
    refused(r"\[decode.d\] quant_attention must be str, got 4", quant_attention=4)
    f32_attention = 'node d: quant_attention = "int8" needs dtype = "bfloat16"'
    refused(f32_attention, dtype="float32", quant_attention="int8")
    f32_quant = 'node d: quant = "int4" needs dtype = "bfloat16"'
    refused(f32_quant, dtype="float32", quant="int4", quant_attention="none")
    f32 = ClusterConfig.from_dict(
        {
            "dtype": "float32",
            "prefill": [{"name": "p", "quant_attention": "none"}],
            "decode": [{"name": "d"}],
        }
    )
    assert f32.prefill[0].quant_attention == "none"  # the model dtype's kernels take fp32
