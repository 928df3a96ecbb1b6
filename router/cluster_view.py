"""`GET /v1/cluster`: every configured node as the router sees it, for operators (`duet status`).

One entry per node of the cluster config, in config order (prefill nodes first), heard from or
not, then one per node that joined at run time (`router.membership`; `"joined": true`, its
settings those of its role's first entry). Each joins three sources:
  - the config: control address, decode KV address, device, threads, page size, ranks;
  - the node's NodeReady info (dtype, ranks, page size, version) and its latest Heartbeat
    (queue, KV pages, draining), so these figures lag by up to one heartbeat interval;
  - the router's own state: status, error, `last_heartbeat_s` (seconds since the node was last
    heard from: a heartbeat or its NodeReady), `active` (the router's unfinished requests on it).

`quantization`: what the node's weights run in: its `quant` scheme ("int8", "fp8", "int4"; from its
NodeReady, else the config), or with quant "none" the dtype ("bf16", "fp32"; FP8 checkpoints
are then dequantized at load). `attention`: the attention projections' scheme ("none", "int8",
"fp8", "int4"; `quant_attention`, by default `quant`'s, "int8" under "int4").
`version` is the router's package version at the top, each node's own (from its NodeReady) per
node; None for a node not heard from since the router started.
"""

from __future__ import annotations

import time
from typing import Any

from control.cluster_config import ClusterConfig, DecodeNodeConfig, PrefillNodeConfig
from control.quant_schemes import attention_scheme
from control.version import package_version
from router.nodes import NodeRegistry, NodeState

_SHORT_DTYPE = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def cluster_view(
    cfg: ClusterConfig,
    nodes: NodeRegistry,
    is_serving: bool,
    now: float | None = None,
    replica: int = 0,
) -> dict[str, Any]:
    """The JSON body of `GET /v1/cluster` from router `replica`. `now`: monotonic seconds
    (default: now)."""
    now = time.monotonic() if now is None else now
    own = cfg.router.for_replica(replica)
    return {
        "object": "cluster",
        "version": package_version(),
        "ratio": cfg.ratio,
        "model": cfg.model,
        "dtype": cfg.dtype,
        "is_serving": is_serving,
        "router": {
            "url": f"http://{own.host}:{own.port}",
            "control_endpoint": own.control_endpoint,
            "replica": replica,
            "replicas": cfg.router.replicas,
        },
        "nodes": [
            node_view(node, nodes.nodes[node.name], cfg.dtype, now)
            for node in (*cfg.prefill, *cfg.decode)
        ]
        + [
            {**node_view(joined_config(cfg, state), state, cfg.dtype, now), "joined": True}
            for state in nodes.nodes.values()
            if state.joined
        ],
    }


def joined_config(cfg: ClusterConfig, state: NodeState) -> PrefillNodeConfig | DecodeNodeConfig:
    """A joined node's settings as the router knows them: its role's template under the
    addresses it announced (`ClusterConfig.joining_node`, as the node itself built them)."""
    host, port = state.control_endpoint.removeprefix("tcp://").rsplit(":", 1)
    kv = str(state.info.get("kv_endpoint", "")).rsplit(":", 1)
    kv_port = int(kv[1]) if state.role == "decode" and len(kv) == 2 and kv[1].isdigit() else 0
    return cfg.joining_node(state.role, state.name, int(port), kv_port or int(port) + 1, host)


def node_view(
    node: PrefillNodeConfig | DecodeNodeConfig, state: NodeState, cluster_dtype: str, now: float
) -> dict[str, Any]:
    """One node's entry; heartbeat figures are None until its first heartbeat."""
    hb, info = state.heartbeat, state.info
    dtype = str(info.get("dtype", cluster_dtype))
    is_decode = isinstance(node, DecodeNodeConfig)
    return {
        "name": node.name,
        "role": state.role,
        "status": state.status,
        "error": state.error or None,
        "address": node.control_endpoint,
        "kv_endpoint": str(info.get("kv_endpoint", node.kv_endpoint)) if is_decode else None,
        "device": node.device,
        "threads": node.threads,
        "dtype": dtype,
        "quantization": _weights_form(str(info.get("quant", node.quant)), dtype),
        # the LM head's own scheme ("none": the model dtype; "int8" with quant_lm_head)
        "lm_head": str(info.get("lm_head", "int8" if node.quant_lm_head else "none")),
        "attention": str(
            info.get("attention", attention_scheme(node.quant, node.quant_attention or None))
        ),
        "weights": str(info.get("weights", "")) or None,  # where they live (a pack, the heap)
        "page_size": state.page_size if is_decode else node.page_size,
        "ranks": int(info.get("ranks", node.ranks)) if is_decode else 1,
        "kv_pages": _kv_pages(state) if is_decode else None,
        "queue": {
            "waiting": hb.num_waiting if hb else None,
            "running": hb.num_running if hb else None,
            "queued_tokens": hb.queued_tokens if hb and not is_decode else None,
        },
        "active": state.num_active,  # the router's unfinished requests on it
        "last_heartbeat_s": round(now - state.last_seen, 3) if state.last_seen else None,
        "draining": bool(hb.draining) if hb else state.status == "draining",
        "version": info.get("version"),
    }


def _weights_form(quant: str, dtype: str) -> str:
    return quant if quant != "none" else _SHORT_DTYPE.get(dtype, dtype)


def _kv_pages(state: NodeState) -> dict[str, int | None]:
    """Used/free from the node's heartbeat (its own count); total from the heartbeat, else its
    NodeReady or the config."""
    hb = state.heartbeat
    if hb is None or hb.total_pages <= 0:
        return {"used": None, "free": None, "total": state.total_pages}
    return {"used": hb.total_pages - hb.free_pages, "free": hb.free_pages, "total": hb.total_pages}
