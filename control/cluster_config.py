"""Cluster config: one TOML file read by the router and every node's launch script.

    model = ""                # checkpoint dir; empty = the built-in tiny model
    dtype = "bfloat16"
    [sla]       ttft_ms = 1000, tpot_ms = 50, admission = "none" | "reject" | "queue", queue_s,
                kv_bytes_per_s, cap_decode_batch
    [router]    host, bind_host, port (HTTP), control_port (ZeroMQ PULL for node messages), limits
    [timeouts]  reserve_s, prefill_queue_s, transfer_s, decode_s, heartbeat_s, node_timeout_s,
                drain_s, lease_s
    [autoscale] enabled, min_/max_prefill, min_/max_decode, interval_s, sustain_s, idle_s,
                cooldown_s, window_s, sla_target, prefill_up/down_tokens, decode_up/down_share
    [security]  curve_key_file (ZeroMQ CURVE on every inter-node socket), insecure, kv_security,
                api_key_file / api_keys (HTTP Bearer keys), metrics_need_key
    [[prefill]] name, host, bind_host, control_port, threads, page_size, chunk_size, replicas,
                device, prefix_cache, disk_cache_dir, disk_cache_gb, quant, quant_attention,
                quant_lm_head, mtp_draft_head, pack, weights_cache
    [[decode]]  name, host, bind_host, control_port, kv_port, threads, page_size, num_pages,
                max_batch, ranks, replicas, device, kv_reservation, kv_headroom_tokens, quant,
                quant_attention, quant_lm_head, pack, weights_cache, mtp, mtp_tokens,
                mtp_draft_head, overlap, prefix_cache

`quant` ("none", "int8", "fp8", "int4"; model.quant) is each node's own weight scheme: the KV it
produces or consumes is the same whatever the scheme, so any prefill node feeds any decode node.
It covers the MLPs and experts; the attention projections (q / q_a / q_b / kv_a / o_proj) run
in `quant_attention` ("none", "int8", "fp8", "int4"; default unset: `quant`'s own, but "int8"
under "int4", `control.quant_schemes.attention_scheme`), e.g. `quant = "int4"` with
`quant_attention = "none"`: 4-bit MLPs, attention in the model dtype. Every scheme but "none",
in either key, needs dtype = "bfloat16".
`quant_lm_head` (bool, default false) runs the node's LM head in int8 W8A8 whatever its `quant`
("none" included): the head, the largest matrix a small decode batch reads, in half the bytes,
for logits within int8 rounding of the model-dtype head's. Its kernel takes bf16 and float32
activations, so it goes with either `dtype`.

`mtp = true` makes a decode node speculate with the checkpoint's MTP layer, verifying
`mtp_tokens` drafts a step (`runtime.speculative`). The MTP layer's KV is one more layer of the
cache, which the prefill nodes compute and send: so every decode node must agree on `mtp`, and
the prefill nodes run the MTP layer exactly when they do (`ClusterConfig.uses_mtp`). Every node
running the MTP layer drafts through a copy of the LM head in `mtp_draft_head` ("int4" by
default, "int8", or "none": the main head itself), a quarter of a bf16 head's bytes a draft at
int4; drafts are verified by the main head, so the output is the same whatever it is.

Addresses: `host` is where the other roles (and, for the router, HTTP clients) reach a role; it
is the address in every endpoint the role names, e.g. a decode node's `kv_endpoint`. `bind_host`
is what its sockets bind: empty (the default) means `host`, "0.0.0.0" every interface. So a role
behind an address it does not own (NAT), or one listening on every interface, sets both; `host`
itself is never a wildcard.

The xPyD ratio is the number of [[prefill]] and [[decode]] entries after `replicas` expansion
(replica i of "p" is named "p-i" and takes ports + i). Everything is validated here, once.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from control.errors import ConfigError
from control.kv_reservation import MODES as KV_RESERVATION_MODES
from control.placement import parse_cpu_list
from control.quant_schemes import DEFAULT_DRAFT_HEAD, parse_draft_head, parse_quant

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

WILDCARD_HOSTS = ("0.0.0.0",)  # binds every interface; never an address to connect to
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-_]*")  # a host name or an IPv4 address
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-_]{0,62}")
REASONING_PARSERS = ("deepseek_r1",)  # the chat output formats `router.reasoning` splits
TOOL_PARSERS = ("hermes", "deepseek_v3")  # the tool-call formats `router.tool_parsers` reads
MAX_ROUTERS = 8  # router replicas in front of one cluster's nodes (`control.router_links`)


class _Addresses:
    """`host` (what peers connect to) and `bind_host` (what the sockets bind, "" = `host`) of a
    role; the endpoints built from them."""

    host: str
    bind_host: str
    control_port: int

    @property
    def listen_host(self) -> str:
        return self.bind_host or self.host

    @property
    def binds_every_interface(self) -> bool:
        return self.listen_host in WILDCARD_HOSTS

    @property
    def control_endpoint(self) -> str:
        """Where peers send this role's control messages."""
        return f"tcp://{self.host}:{self.control_port}"

    @property
    def control_bind_endpoint(self) -> str:
        return f"tcp://{self.listen_host}:{self.control_port}"

    @property
    def group_host(self) -> str:
        """Where the ranks' gloo group listens (ranks > 1; all ranks share one machine): the
        bound address, or `host` when the node binds every interface (127.0.0.1 if `host` turns
        out not to be this machine's: `runtime.rank_group.rendezvous_listener`)."""
        return self.host if self.binds_every_interface else self.listen_host


@dataclass(frozen=True)
class SlaConfig:
    ttft_ms: float = 1000.0
    tpot_ms: float = 50.0
    # ---- SLA admission (router/admission.py, control/cost_model.py) --------
    # What a request whose predicted TTFT exceeds ttft_ms on every prefill node gets: "reject"
    # (503 + Retry-After), "queue" (waits at the router up to queue_s, then 503), "none" (served).
    admission: str = "none"
    queue_s: float = 5.0  # admission = "queue": the longest a request waits at the router
    # admission = "none": a request no decode node has room for waits for room, in turn
    # (preempted ones first, then FIFO), this long at most (then 503 no_decode_room).
    queue_timeout_s: float = 600.0
    kv_bytes_per_s: float = 1e9  # KV transfer rate the TTFT estimate assumes (loopback/LAN)
    cap_decode_batch: bool = True  # decode nodes cap their batch to keep steps within tpot_ms


@dataclass(frozen=True)
class TimeoutConfig:
    reserve_s: float = 10.0  # router waits this long for a decode node's ReserveReply
    prefill_queue_s: float = 60.0  # a request may wait this long in a prefill queue
    transfer_s: float = 60.0  # decode waits this long for the whole KV after reserving
    decode_s: float = 600.0  # a request may decode this long in total
    heartbeat_s: float = 0.5  # nodes send a heartbeat this often
    node_timeout_s: float = 5.0  # a node silent this long is dead
    drain_s: float = 30.0  # a SIGTERMed node finishes its requests for at most this long
    lease_s: float = 10.0  # a node aborts requests whose router has been silent this long


@dataclass(frozen=True)
class RouterConfig(_Addresses):
    host: str = "127.0.0.1"  # nodes connect here, HTTP clients too (the URL's host)
    bind_host: str = ""  # HTTP and the control socket bind this; "" = host, "0.0.0.0" = all
    port: int = 8000
    control_port: int = 7000
    max_queued_requests: int = 512  # beyond this many unfinished requests: 503
    max_tokens_limit: int = 4096  # the largest max_tokens a request may ask for
    max_body_bytes: int = 8 * 1024 * 1024  # a larger HTTP body gets 413
    max_prompt_tokens: int = 0  # 0: the model's context; more prompt tokens get 400
    max_concurrent_per_key: int = 0  # 0: unlimited; more unfinished requests per key get 429
    max_migrations: int = 2  # a request moves to another node pair at most this often
    # On-demand decode KV: a request preempted by a decode node whose pool
    # ran out is re-prefilled at most this often (not counted in max_migrations), then fails.
    max_preemptions: int = 8
    # Cache-aware routing: a prompt goes to the prefill node with the longest cached
    # prefix among those whose queue is at most this many tokens longer than the shortest.
    cache_balance_tokens: int = 2048
    # Reasoning models (`router.reasoning`): "deepseek_r1" splits the chat output's
    # `<think>...</think>` into `reasoning_content`; "" leaves the output as it is.
    reasoning_parser: str = ""
    # Tool calling (`router.tool_parsers`): how the model writes calls, "hermes" or
    # "deepseek_v3"; "" refuses requests that ask for tool calls.
    tool_parser: str = ""
    # Routers in front of the same nodes (`control.router_links`): replica i serves HTTP on
    # port + i and its control socket on control_port + i, on `host`; or, with
    # `replica_hosts` (one per replica: routers on several hosts, Kubernetes' router pods), on
    # replica_hosts[i] and the ports as they are. Every node serves every router; one
    # router's death ends only its own streams.
    replicas: int = 1
    replica_hosts: tuple[str, ...] = ()

    def for_replica(self, replica: int) -> RouterConfig:
        """Replica `replica`'s own addresses (replica 0: this config's, unless
        `replica_hosts` places it)."""
        if not 0 <= replica < self.replicas:
            raise ConfigError(f"[router] has {self.replicas} replicas, no replica {replica}")
        if self.replica_hosts:
            return dataclasses.replace(self, host=self.replica_hosts[replica])
        return dataclasses.replace(
            self, port=self.port + replica, control_port=self.control_port + replica
        )

    @property
    def control_endpoints(self) -> list[str]:
        """Where a node sends its messages: every replica's control endpoint, in order."""
        return [self.for_replica(i).control_endpoint for i in range(self.replicas)]


@dataclass(frozen=True)
class PrefillNodeConfig(_Addresses):
    name: str
    host: str = "127.0.0.1"  # the router connects here
    bind_host: str = ""  # the control socket binds this; "" = host, "0.0.0.0" = all
    control_port: int = 7100
    device: str = "cpu"
    threads: int = 1
    page_size: int = 16
    chunk_size: int = 256
    num_pages: int = 4096
    max_batch_tokens: int = 512  # token budget of one prefill forward (chunks of several requests)
    # Prefix cache: finished prompts' KV pages stay cached in the pool (LRU), and a
    # prompt starting with a cached prefix computes only the rest. false: every prompt cold
    # (and the router pairs this node by load alone).
    prefix_cache: bool = True
    # The prefix cache's disk tier (`runtime.kv_disk_store`): pages evicted from the pool are
    # written under this directory (one store per model and KV layout, shared by every prefill
    # node of the host that names it, kept across restarts) and read back on a hit; at most
    # `disk_cache_gb` GiB, least recently used pages dropped first. "": no disk tier. Best
    # absolute: a relative path is the node process's working directory's.
    disk_cache_dir: str = ""
    disk_cache_gb: float = 4.0
    quant: str = "none"  # weight quantization: "none" | "int8" | "fp8" | "int4"
    # The attention projections' own scheme (same names); "": `quant`'s ("int8" under "int4")
    quant_attention: str = ""
    quant_lm_head: bool = False  # the LM head in int8 W8A8, whatever `quant` is
    # With MTP: the LM head the drafts run through ("int4" | "int8" | "none": the main head);
    # the main head verifies, so this moves the acceptance, never the output (model.draft_head)
    mtp_draft_head: str = DEFAULT_DRAFT_HEAD
    # Packed weights (`model.weight_pack`): `pack` maps this packed weight store (made by
    # `duet pack`) instead of loading the checkpoint; else with `weights_cache` the node builds
    # the pack once under the cache dir (keyed by checkpoint, scheme, dtype and shard) and maps
    # it, so every process on the host shares one copy and a restart maps instead of rebuilding.
    pack: str = ""
    weights_cache: bool = True
    # Tensor parallelism (`prefill_node.ranks`): `ranks` processes on this machine,
    # each holding its share of the heads, MLP columns and routed experts, `threads` each; rank
    # 0 talks to the router and streams the KV, which is the same whatever the ranks.
    ranks: int = 1
    # "tp": heads and MLPs split, two all-reduces a layer (`model.tensor_parallel`); "tp_sp":
    # heads split, the rest sequence-split (`model.sequence_parallel`), every rank holding the
    # whole MLPs and experts: a fifth of the traffic for R times their memory.
    parallel: str = "tp"
    all_reduce: str = "shm"  # "shm" (one shared-memory segment) | "gloo" (torch.distributed)
    # Core placement of the ranks (`control.placement`): "auto" gives each rank its own share
    # of the cores this process may use (a NUMA node's, memory bound there, where the machine
    # has several); "off" leaves it to the OS. `rank_cpus` names each rank's cores instead
    # (Linux list format, "0-3,8"), one entry a rank.
    pin: str = "auto"
    rank_cpus: tuple[str, ...] = ()
    # Ranks on other hosts: the address of each of ranks 1..R-1 (where its gloo sockets
    # listen), each started there by `deploy/launch_prefill_rank.sh`; rank 0 then starts none.
    # Empty: every rank is a child of rank 0 on this machine. Needs all_reduce = "gloo" and a
    # fixed group_port (rank 0's rendezvous, on its group_host).
    rank_hosts: tuple[str, ...] = ()
    group_port: int = 0  # 0: a free port (ranks on this machine only)

    @property
    def hosts_of_ranks(self) -> tuple[str, ...]:
        """Each rank's address: rank 0's group_host, then rank_hosts (or rank 0's again)."""
        return (self.group_host, *(self.rank_hosts or (self.group_host,) * (self.ranks - 1)))


@dataclass(frozen=True)
class DecodeNodeConfig(_Addresses):
    name: str
    host: str = "127.0.0.1"  # the router and the prefill nodes (KV) connect here
    bind_host: str = ""  # control and every rank's KV socket bind this; "" = host, "0.0.0.0" = all
    control_port: int = 7200
    kv_port: int = 7300
    device: str = "cpu"
    threads: int = 1
    page_size: int = 16
    num_pages: int = 4096
    max_batch: int = 64  # running requests per rank
    ranks: int = 1
    # On-demand decode KV (rule in control.kv_reservation): "on_demand"
    # reserves the prompt + kv_headroom_tokens and grows as it decodes, preempting the newest
    # request when the pool runs out; "worst_case" reserves prompt + max_tokens up front.
    kv_reservation: str = "on_demand"
    kv_headroom_tokens: int = 32
    quant: str = "none"  # weight quantization: "none" | "int8" | "fp8" | "int4"
    # The attention projections' own scheme (same names); "": `quant`'s ("int8" under "int4")
    quant_attention: str = ""
    quant_lm_head: bool = False  # the LM head in int8 W8A8, whatever `quant` is
    # With MTP: the LM head the drafts run through ("int4" | "int8" | "none": the main head);
    # the main head verifies, so this moves the acceptance, never the output (model.draft_head)
    mtp_draft_head: str = DEFAULT_DRAFT_HEAD
    # Packed weights (`model.weight_pack`): `pack` maps this packed weight store (made by
    # `duet pack`) instead of loading the checkpoint; else with `weights_cache` the node builds
    # the pack once under the cache dir (keyed by checkpoint, scheme, dtype and shard) and maps
    # it, so every process on the host shares one copy and a restart maps instead of rebuilding.
    pack: str = ""
    weights_cache: bool = True
    # MTP speculative decoding: draft with the checkpoint's MTP layer, verify
    # mtp_tokens drafts per step.
    mtp: bool = False
    mtp_tokens: int = 1
    # The overlapped step (`decode_node.step_overlap`): while the forward runs, a
    # helper thread emits the last step's tokens and takes in the next one's inputs.
    # Single-rank nodes without MTP; elsewhere the step runs in order. Off by default: it
    # needs a core the kernels leave free, and on a 2-core host it measured no gain.
    overlap: bool = False
    # Prefix reuse (`decode_node.scheduler`): the prompt pages of finished requests stay in
    # the pool (LRU, evicted before a request is refused or preempted); a prompt starting with
    # them reserves and receives only the rest, and the router pairs prompts with the decode
    # node that holds most of them. Off by default: the pool's free pages then stay the
    # requests' alone. Single-rank nodes.
    prefix_cache: bool = False

    @property
    def kv_endpoint(self) -> str:
        """Rank 0's KV receiver as the prefill nodes reach it (in NodeReady and ReserveReply)."""
        return f"tcp://{self.host}:{self.kv_port}"

    @property
    def kv_bind_endpoint(self) -> str:
        return f"tcp://{self.listen_host}:{self.kv_port}"


@dataclass(frozen=True)
class AutoscaleConfig:
    """`duet up --autoscale` (`router.autoscaler`): the router starts nodes that join the
    cluster (`duet node`'s way) and drains them, within these bounds per role, from live
    signals: a role scales up when its load stays above the "up" mark for `sustain_s` (prefill:
    prompt tokens queued per node; decode: the share of KV pages held), and down when it stays
    below the "down" mark for `idle_s`; after a change a role waits `cooldown_s`. SLA
    attainment over `window_s` below `sla_target` (the share of finished requests within the
    SLA) also scales up the role that misses its part most (TTFT: prefill, TPOT: decode). The nodes of
    the config are never drained: the bounds count them.

    `launcher`: "local" starts node processes on the router's host; "kubernetes" scales each
    role's pool Deployment (`pool_name`, rendered by `duet k8s render`) in `namespace` (default:
    the router pod's own) through the Kubernetes API."""

    enabled: bool = False
    launcher: str = "local"
    namespace: str = ""
    min_prefill: int = 1
    max_prefill: int = 2
    min_decode: int = 1
    max_decode: int = 2
    interval_s: float = 1.0  # how often the signals are read and a decision taken
    sustain_s: float = 3.0
    idle_s: float = 30.0
    cooldown_s: float = 10.0
    window_s: float = 30.0
    sla_target: float = 0.9
    prefill_up_tokens: int = 4096  # queued prompt tokens per ready prefill node
    prefill_down_tokens: int = 0
    decode_up_share: float = 0.8  # KV pages held per ready decode node
    decode_down_share: float = 0.2


def pool_name(role: str) -> str:
    """The Kubernetes Deployment of a role's joining nodes (its pods are nodes named after
    themselves); `kubectl scale` or the autoscaler set its replicas."""
    return f"{role}-pool"


@dataclass(frozen=True)
class SecurityConfig:
    """Who may talk to the cluster.

    Node traffic (control and KV sockets) is ZeroMQ CURVE with one cluster key pair
    (`duet keygen`): a peer without the secret key cannot connect. `insecure = true` turns it
    off (plain TCP; every node warns at start). HTTP clients need `Authorization: Bearer KEY`
    with a key from `api_key_file` (one per line) or `api_keys` when either is set."""

    curve_key_file: str = ""  # the cluster's key pair (public + secret), from `duet keygen`
    insecure: bool = False  # plain ZeroMQ without CURVE: only where the network is trusted
    api_key_file: str = ""  # HTTP API keys, one per line ('#' comments)
    api_keys: tuple[str, ...] = ()  # the same inline (prefer the file: keys stay out of the TOML)
    metrics_need_key: bool = False  # /metrics asks for a key too (/health never does)
    # The KV links (prefill -> decode) of a CURVE cluster: "curve" (the sockets run CURVE, as the
    # control links), or "aead" (plain sockets, every KV message sealed with AES-256-GCM under a
    # key per transfer handed over the CURVE control links: kvtransfer.sealing). No effect with
    # insecure = true.
    kv_security: str = "curve"


@dataclass(frozen=True)
class ClusterConfig:
    model: str = ""
    dtype: str = "bfloat16"
    sla: SlaConfig = field(default_factory=SlaConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    prefill: tuple[PrefillNodeConfig, ...] = ()
    decode: tuple[DecodeNodeConfig, ...] = ()

    @property
    def uses_mtp(self) -> bool:
        """The KV layout has the MTP layer's cache: the decode nodes speculate (they agree)."""
        return any(node.mtp for node in self.decode)

    @property
    def ratio(self) -> str:
        return f"{len(self.prefill)}P{len(self.decode)}D"

    def node(self, name: str) -> PrefillNodeConfig | DecodeNodeConfig:
        for node in (*self.prefill, *self.decode):
            if node.name == name:
                return node
        names = ", ".join(n.name for n in (*self.prefill, *self.decode))
        raise ConfigError(f"no node named {name!r} in the cluster config (nodes: {names})")

    def joining_node(
        self, role: str, name: str, control_port: int, kv_port: int = 0, host: str = ""
    ) -> PrefillNodeConfig | DecodeNodeConfig:
        """The config of a node that joins the running cluster (it is not in this file): the
        first [[prefill]] or [[decode]] entry's settings under its own name, address and
        ports. ConfigError for a name of the file, a bad name or port, or a template of
        several ranks (a joining node runs one)."""
        if role not in ("prefill", "decode"):
            raise ConfigError(f"a joining node is a prefill or a decode node, not {role!r}")
        if any(n.name == name for n in (*self.prefill, *self.decode)):
            raise ConfigError(f"node {name!r} is in the cluster config: start it with --node")
        if not _NODE_NAME.fullmatch(name):
            raise ConfigError(f"node name {name!r}: letters, digits, '.', '-', '_' (at most 63)")
        template = (self.prefill if role == "prefill" else self.decode)[0]
        if template.ranks > 1:
            raise ConfigError(f"a joining {role} node runs one rank: [[{role}]] has several")
        ports = [control_port, kv_port] if role == "decode" else [control_port]
        if not all(0 < p < 65536 for p in ports) or len(set(ports)) != len(ports):
            raise ConfigError(f"node {name}: needs its own ports in [1, 65535], got {ports}")
        fields: dict[str, Any] = {"name": name, "control_port": control_port}
        if role == "decode":
            fields["kv_port"] = kv_port
        if host:
            if not _HOST.fullmatch(host) or host in WILDCARD_HOSTS:
                raise ConfigError(f"node {name}: host {host!r} is not an address to reach it at")
            fields["host"] = host
        return dataclasses.replace(template, **fields)

    def with_model(self, model: str) -> ClusterConfig:
        return dataclasses.replace(self, model=model)

    @classmethod
    def load(cls, path: str | Path) -> ClusterConfig:
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the cluster config ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML ({exc})") from None
        try:
            return cls.from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ClusterConfig:
        _check_keys(
            "top level",
            raw,
            {"model", "dtype", "sla", "router", "timeouts", "security", "autoscale"}
            | {"prefill", "decode"},
        )
        cfg = cls(
            model=str(raw.get("model", "")),
            dtype=raw.get("dtype", "bfloat16"),
            sla=_section(SlaConfig, "sla", raw.get("sla", {})),
            router=_section(RouterConfig, "router", raw.get("router", {})),
            timeouts=_section(TimeoutConfig, "timeouts", raw.get("timeouts", {})),
            security=_section(SecurityConfig, "security", raw.get("security", {})),
            autoscale=_section(AutoscaleConfig, "autoscale", raw.get("autoscale", {})),
            prefill=_nodes(PrefillNodeConfig, "prefill", raw.get("prefill", [])),
            decode=_nodes(DecodeNodeConfig, "decode", raw.get("decode", [])),
        )
        _validate(cfg)
        return cfg


def _check_keys(where: str, raw: dict[str, Any], allowed: set[str]) -> None:
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")


def _section(cls, where: str, raw: Any):
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] must be a table")
    fields_ = {f.name: f for f in dataclasses.fields(cls)}
    _check_keys(f"[{where}]", raw, set(fields_))
    values = {}
    for name, value in raw.items():
        default = fields_[name].default
        kind = type(default) if default is not dataclasses.MISSING else str
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is tuple:  # a list of strings in TOML
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"[{where}] {name} must be a list of strings, got {value!r}")
            value = tuple(value)
        if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
            raise ConfigError(f"[{where}] {name} must be {kind.__name__}, got {value!r}")
        values[name] = value
    return cls(**values)


def _nodes(cls, role: str, raw: Any) -> tuple:
    if not isinstance(raw, list):
        raise ConfigError(f"[[{role}]] must be an array of tables")
    nodes = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise ConfigError(f"[[{role}]] entry {i} must be a table")
        entry = dict(entry)
        replicas = entry.pop("replicas", 1)
        if not isinstance(replicas, int) or replicas < 1:
            raise ConfigError(f"[[{role}]] entry {i}: replicas must be a positive int")
        entry.setdefault("name", f"{role}-{i}")
        base = _section(cls, f"{role}.{entry['name']}", entry)
        if replicas == 1:
            nodes.append(base)
            continue
        if getattr(base, "rank_hosts", ()):
            raise ConfigError(
                f"[[{role}]] {base.name}: rank_hosts names one node's hosts; list each replica "
                "as its own entry instead of replicas"
            )
        for r in range(replicas):
            ports = {  # (0: a free port, picked at start, stays 0)
                f.name: getattr(base, f.name) + (r if getattr(base, f.name) else 0)
                for f in dataclasses.fields(cls)
                if f.name.endswith("_port")
            }
            nodes.append(dataclasses.replace(base, name=f"{base.name}-{r}", **ports))
    return tuple(nodes)


def _validate_quant(node: PrefillNodeConfig | DecodeNodeConfig, dtype: str) -> None:
    """The node's `quant` and `quant_attention`: known names, and bf16 for any but "none"; its
    `mtp_draft_head` a known name (its kernels take either dtype)."""
    parse_draft_head(node.mtp_draft_head, f"node {node.name}: mtp_draft_head")
    keys = [("quant", parse_quant(node.quant, f"node {node.name}: quant"))]
    if node.quant_attention:  # "" leaves it to `quant` (control.quant_schemes.attention_scheme)
        where = f"node {node.name}: quant_attention"
        keys.append(("quant_attention", parse_quant(node.quant_attention, where)))
    for key, scheme in keys:
        if scheme != "none" and dtype != "bfloat16":
            raise ConfigError(
                f'node {node.name}: {key} = "{scheme}" needs dtype = "bfloat16" (its '
                f"kernels take bf16 activations), got {dtype!r}"
            )


def _validate(cfg: ClusterConfig) -> None:
    if cfg.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"dtype must be float32 or bfloat16, got {cfg.dtype!r}")
    _validate_security(cfg.security)
    _validate_autoscale(cfg)
    if not cfg.prefill or not cfg.decode:
        raise ConfigError("a cluster needs at least one [[prefill]] and one [[decode]] node")
    names = [n.name for n in (*cfg.prefill, *cfg.decode)]
    if len(set(names)) != len(names):
        raise ConfigError(f"node names must be unique, got {names}")
    _check_addresses("[router]", cfg.router)
    for node in (*cfg.prefill, *cfg.decode):
        _check_addresses(f"node {node.name}", node)
    if not 1 <= cfg.router.replicas <= MAX_ROUTERS:
        raise ConfigError(
            f"[router] replicas must be 1 to {MAX_ROUTERS}, got {cfg.router.replicas}"
        )
    hosts = cfg.router.replica_hosts
    if hosts and (len(hosts) != cfg.router.replicas or len(set(hosts)) != len(hosts)):
        raise ConfigError(
            f"[router] replica_hosts must name {cfg.router.replicas} distinct hosts (one per "
            f"replica), got {list(hosts)}"
        )
    for host in hosts:
        if host in WILDCARD_HOSTS or not _HOST.fullmatch(host):
            raise ConfigError(f"[router] replica_hosts: {host!r} is not a host name or address")
    endpoints = []
    for i in range(cfg.router.replicas):
        replica = cfg.router.for_replica(i)
        endpoints += [(replica.host, replica.port), (replica.host, replica.control_port)]
    for node in cfg.prefill:
        endpoints.append((node.host, node.control_port))
        if node.group_port:
            endpoints.append((node.group_host, node.group_port))
    for node in cfg.decode:
        endpoints += [(node.host, node.control_port), (node.host, node.kv_port)]
    if len(set(endpoints)) != len(endpoints):
        raise ConfigError("two sockets of the cluster share a host:port")
    for node in (*cfg.prefill, *cfg.decode):
        if node.threads < 1 or node.page_size < 1 or node.num_pages < 1:
            raise ConfigError(f"node {node.name}: threads, page_size and num_pages must be >= 1")
        if node.device not in ("cpu", "cuda") and not node.device.startswith("cuda:"):
            raise ConfigError(f"node {node.name}: unsupported device {node.device!r}")
        _validate_quant(node, cfg.dtype)
    for node in cfg.decode:
        if node.ranks < 1 or node.max_batch < 1:
            raise ConfigError(f"node {node.name}: ranks and max_batch must be >= 1")
        if node.kv_reservation not in KV_RESERVATION_MODES:
            raise ConfigError(
                f"node {node.name}: kv_reservation must be one of "
                f"{', '.join(KV_RESERVATION_MODES)}, got {node.kv_reservation!r}"
            )
        if node.kv_headroom_tokens < 0:
            raise ConfigError(f"node {node.name}: kv_headroom_tokens must be >= 0")
        _validate_mtp(node, cfg.uses_mtp)
        if node.prefix_cache and node.ranks > 1:
            raise ConfigError(
                f"node {node.name}: prefix_cache on a decode node of several ranks is not "
                "supported yet (each rank has its own pool; the rank choice ignores caches)"
            )
    for node in cfg.prefill:
        if node.chunk_size < 1 or node.max_batch_tokens < node.chunk_size:
            raise ConfigError(f"node {node.name}: need 1 <= chunk_size <= max_batch_tokens")
        if node.disk_cache_dir and (not node.prefix_cache or node.disk_cache_gb <= 0):
            raise ConfigError(
                f"node {node.name}: disk_cache_dir needs prefix_cache = true and disk_cache_gb > 0"
            )
        _validate_prefill_ranks(node, cfg.uses_mtp)
    r = cfg.router
    if r.max_body_bytes < 1024 or r.max_prompt_tokens < 0 or r.max_concurrent_per_key < 0:
        raise ConfigError(
            "[router] max_body_bytes must be >= 1024, max_prompt_tokens and "
            "max_concurrent_per_key >= 0"
        )
    if r.max_migrations < 0:
        raise ConfigError("[router] max_migrations must be >= 0")
    if r.max_preemptions < 0:
        raise ConfigError("[router] max_preemptions must be >= 0")
    if r.cache_balance_tokens < 0:
        raise ConfigError("[router] cache_balance_tokens must be >= 0")
    if r.reasoning_parser not in ("", *REASONING_PARSERS):
        raise ConfigError(
            f"[router] reasoning_parser must be one of {', '.join(REASONING_PARSERS)} "
            f"(or empty), got {r.reasoning_parser!r}"
        )
    if r.tool_parser not in ("", *TOOL_PARSERS):
        raise ConfigError(
            f"[router] tool_parser must be one of {', '.join(TOOL_PARSERS)} (or empty), "
            f"got {r.tool_parser!r}"
        )
    t = cfg.timeouts
    if min(t.reserve_s, t.prefill_queue_s, t.transfer_s, t.decode_s, t.heartbeat_s) <= 0:
        raise ConfigError("[timeouts] must all be positive")
    if t.node_timeout_s <= t.heartbeat_s or t.lease_s <= t.heartbeat_s or t.drain_s <= 0:
        raise ConfigError("[timeouts] node_timeout_s and lease_s must exceed heartbeat_s")
    if cfg.sla.ttft_ms <= 0 or cfg.sla.tpot_ms <= 0:
        raise ConfigError("[sla] ttft_ms and tpot_ms must be positive")
    _validate_admission(cfg.sla)


PARALLEL_SCHEMES = ("tp", "tp_sp")
ALL_REDUCES = ("shm", "gloo")
PIN_MODES = ("auto", "off")


def _validate_prefill_ranks(node: PrefillNodeConfig, uses_mtp: bool) -> None:
    """A prefill node's tensor parallelism; the model's own split (heads, MLP and
    expert counts) is checked against `ranks` when it loads (`model.sharding`)."""
    if node.ranks < 1:
        raise ConfigError(f"node {node.name}: ranks must be >= 1")
    for key, value, allowed in (
        ("parallel", node.parallel, PARALLEL_SCHEMES),
        ("all_reduce", node.all_reduce, ALL_REDUCES),
        ("pin", node.pin, PIN_MODES),
    ):
        if value not in allowed:
            raise ConfigError(
                f"node {node.name}: {key} must be one of {', '.join(allowed)}, got {value!r}"
            )
    if node.rank_cpus and len(node.rank_cpus) != node.ranks:
        raise ConfigError(
            f"node {node.name}: rank_cpus names {len(node.rank_cpus)} core sets for "
            f"{node.ranks} ranks"
        )
    for cpus in node.rank_cpus:
        try:
            parse_cpu_list(cpus)
        except ConfigError as exc:
            raise ConfigError(f"node {node.name}: rank_cpus: {exc}") from None
    if node.rank_hosts:
        if len(node.rank_hosts) != node.ranks - 1:
            raise ConfigError(
                f"node {node.name}: rank_hosts names {len(node.rank_hosts)} hosts for ranks "
                f"1..{node.ranks - 1}"
            )
        for host in node.rank_hosts:
            if not _HOST.fullmatch(host) or host in WILDCARD_HOSTS:
                raise ConfigError(
                    f"node {node.name}: rank_hosts: {host!r} is not a host name or IPv4 address "
                    "(nor may it be a wildcard: rank 0 connects to it)"
                )
        if node.all_reduce != "gloo" or not node.group_port:
            raise ConfigError(
                f'node {node.name}: ranks on other hosts (rank_hosts) need all_reduce = "gloo" '
                "and a group_port"
            )
    if not 0 <= node.group_port < 65536:
        raise ConfigError(f"node {node.name}: group_port must be in [0, 65535]")
    if node.ranks > 1 and uses_mtp and node.parallel == "tp_sp":
        raise ConfigError(
            f'node {node.name}: parallel = "tp_sp" cannot run the MTP layer (mtp = true on the '
            'decode nodes) yet: use "tp"'
        )


MAX_MTP_TOKENS = 16  # kvtransfer.wire.MAX_DRAFTS: what one kv_done can carry


def _validate_mtp(node: DecodeNodeConfig, uses_mtp: bool) -> None:
    if node.mtp != uses_mtp:
        raise ConfigError(
            f"node {node.name}: mtp must be the same on every decode node (the MTP layer's "
            "cache is part of the KV the prefill nodes send)"
        )
    if not 1 <= node.mtp_tokens <= MAX_MTP_TOKENS:
        raise ConfigError(f"node {node.name}: mtp_tokens must be in [1, {MAX_MTP_TOKENS}]")


ADMISSION_POLICIES = ("reject", "queue", "none")


KV_SECURITY_MODES = ("curve", "aead")


def _validate_security(security: SecurityConfig) -> None:
    if security.kv_security not in KV_SECURITY_MODES:
        raise ConfigError(
            f"[security] kv_security must be one of {', '.join(KV_SECURITY_MODES)}, "
            f"got {security.kv_security!r}"
        )


AUTOSCALE_LAUNCHERS = ("local", "kubernetes")


def _validate_autoscale(cfg: ClusterConfig) -> None:
    a = cfg.autoscale
    if a.launcher not in AUTOSCALE_LAUNCHERS:
        raise ConfigError(
            f"[autoscale] launcher must be one of {', '.join(AUTOSCALE_LAUNCHERS)}, got "
            f"{a.launcher!r}"
        )
    for role, low, high, fixed in (
        ("prefill", a.min_prefill, a.max_prefill, len(cfg.prefill)),
        ("decode", a.min_decode, a.max_decode, len(cfg.decode)),
    ):
        if not 1 <= low <= high:
            raise ConfigError(f"[autoscale] needs 1 <= min_{role} <= max_{role}")
        if a.enabled and high < fixed:
            raise ConfigError(
                f"[autoscale] max_{role} = {high} is below the config's {fixed} {role} nodes "
                "(they are never drained)"
            )
    times = (a.interval_s, a.sustain_s, a.idle_s, a.window_s)
    if min(times) <= 0 or a.cooldown_s < 0:
        raise ConfigError("[autoscale] interval_s, sustain_s, idle_s, window_s must be > 0")
    if not 0 < a.sla_target <= 1 or not 0 <= a.decode_down_share < a.decode_up_share <= 1:
        raise ConfigError("[autoscale] needs 0 < sla_target <= 1, 0 <= down < up share <= 1")
    if not 0 <= a.prefill_down_tokens < a.prefill_up_tokens:
        raise ConfigError("[autoscale] needs 0 <= prefill_down_tokens < prefill_up_tokens")
    if a.enabled and any(n.ranks > 1 for n in (*cfg.prefill[:1], *cfg.decode[:1])):
        raise ConfigError("[autoscale] starts nodes of one rank: the first node of a role has more")


def _validate_admission(sla: SlaConfig) -> None:
    """SLA admission fields."""
    if sla.admission not in ADMISSION_POLICIES:
        raise ConfigError(
            f"[sla] admission must be one of {', '.join(ADMISSION_POLICIES)}, got {sla.admission!r}"
        )
    if sla.queue_s <= 0:
        raise ConfigError(f"[sla] queue_s must be positive, got {sla.queue_s!r}")
    if sla.queue_timeout_s < 0:
        raise ConfigError(f"[sla] queue_timeout_s must be >= 0, got {sla.queue_timeout_s!r}")
    if sla.kv_bytes_per_s <= 0:
        raise ConfigError(f"[sla] kv_bytes_per_s must be positive, got {sla.kv_bytes_per_s!r}")


def _check_addresses(where: str, role: _Addresses) -> None:
    for key, value in (("host", role.host), ("bind_host", role.bind_host or role.host)):
        if not _HOST.fullmatch(value):  # IPv6 too: the ZeroMQ sockets are IPv4 only
            raise ConfigError(
                f"{where}: {key} must be a host name or an IPv4 address (no scheme, port or "
                f'IPv6; "0.0.0.0" binds every interface), got {value!r}'
            )
    if role.host in WILDCARD_HOSTS:
        raise ConfigError(
            f"{where}: host = {role.host!r} is the address the other roles connect to, so it "
            f'cannot be a wildcard; to listen on every interface set bind_host = "0.0.0.0" and '
            f"host to the address they reach this machine at"
        )
