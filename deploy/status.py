"""`duet status --config FILE [--url URL] [--json] [--api-key K]`: the cluster as its router
sees it (`GET /v1/cluster`), as an aligned table or the JSON itself.

The router's address is the config's `[router] host` and `port` unless `--url` names another.
The API key is `--api-key`, else the first key the config's `[security]` names (`api_keys`, or
`api_key_file` when this host can read it). An unreachable router, a refused key or any other
failure prints one line `error: ...` and exits 1.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

from control.cluster_config import ClusterConfig
from control.errors import ConfigError, DuetError
from control.quant_schemes import QUANT_SCHEMES, attention_scheme

TIMEOUT_S = 10.0

# (header, how to read it from a node entry); None shows as "-"
COLUMNS = (
    ("NAME", lambda n: n["name"]),
    ("ROLE", lambda n: n["role"]),
    ("STATUS", lambda n: n["status"]),
    ("ADDRESS", lambda n: n["address"]),
    ("KV ADDRESS", lambda n: n["kv_endpoint"]),
    ("DEVICE", lambda n: n["device"]),
    ("THREADS", lambda n: n["threads"]),
    ("WEIGHTS", lambda n: _weights(n)),
    ("PAGE", lambda n: n["page_size"]),
    ("RANKS", lambda n: n["ranks"]),
    ("KV USED/FREE/TOTAL", lambda n: _pages(n["kv_pages"])),
    ("WAIT", lambda n: n["queue"]["waiting"]),
    ("RUN", lambda n: n["queue"]["running"]),
    ("QUEUED TOK", lambda n: n["queue"]["queued_tokens"]),
    ("HEARTBEAT", lambda n: _ago(n["last_heartbeat_s"])),
    ("DRAIN", lambda n: "yes" if n["draining"] else "no"),
    ("VERSION", lambda n: n["version"]),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="duet status", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="cluster config (TOML)")
    p.add_argument("--url", help="the router's HTTP address (default: from the config)")
    p.add_argument("--json", action="store_true", help="print the router's JSON")
    p.add_argument("--api-key", help="HTTP API key (default: the config's first)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = ClusterConfig.load(args.config)
    url = (args.url or f"http://{cfg.router.host}:{cfg.router.port}").rstrip("/")
    view = fetch(url, args.api_key or _config_key(cfg))
    print(json.dumps(view, indent=2) if args.json else render(view))
    return 0


def fetch(url: str, api_key: str | None) -> dict[str, Any]:
    """The router's `GET /v1/cluster` body; DuetError with one line on any failure."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{url}/v1/cluster", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise DuetError(
                f"the router at {url} refused the API key (401): pass --api-key"
            ) from None
        raise DuetError(f"the router at {url} answered {exc.code} to /v1/cluster") from None
    except (urllib.error.URLError, OSError) as exc:  # refused, unresolvable, timed out, reset
        reason = getattr(exc, "reason", exc)
        raise DuetError(f"cannot reach the router at {url} ({reason})") from None
    try:
        return json.loads(body)
    except ValueError:
        raise DuetError(f"the router at {url} sent a body that is not JSON") from None


def render(view: dict[str, Any]) -> str:
    """A summary line, the node table (columns padded to their widest cell), then one line per
    node error."""
    state = "serving" if view["is_serving"] else "NOT serving"
    head = (
        f"duet-serve {view['version']}, router {view['router']['url']}: {view['ratio']} "
        f"{view['dtype']}, {state}"
    )
    rows = [[header for header, _ in COLUMNS]]
    for node in view["nodes"]:
        rows.append(["-" if (v := get(node)) is None else str(v) for _, get in COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [head]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    lines += [f"{n['name']}: {n['error']}" for n in view["nodes"] if n["error"]]
    return "\n".join(lines)


def _weights(node: dict[str, Any]) -> str:
    """The weights' scheme (the dtype for "none"), then the attention projections' where it is
    not that scheme's default, and an int8 LM head."""
    text = node["quantization"]
    quant = text if text in QUANT_SCHEMES else "none"
    attention = node.get("attention") or attention_scheme(quant)
    if attention != attention_scheme(quant):
        dense = {"bfloat16": "bf16", "float32": "fp32"}.get(node.get("dtype", ""), "dense")
        text += f"+{dense if attention == 'none' else attention} attn"
    return text + ("+int8 head" if node.get("lm_head") == "int8" else "")


def _pages(pages: dict[str, int | None] | None) -> str | None:
    if pages is None:
        return None
    return "/".join("-" if pages[k] is None else str(pages[k]) for k in ("used", "free", "total"))


def _ago(seconds: float | None) -> str | None:
    return None if seconds is None else f"{seconds:.1f}s ago"


def _config_key(cfg: ClusterConfig) -> str | None:
    security = cfg.security
    if security.api_keys:
        return security.api_keys[0]
    if security.api_key_file:
        from router.auth import read_key_file

        try:
            keys = read_key_file(security.api_key_file)
        except ConfigError:
            return None  # not readable here: a 401 then asks for --api-key
        return keys[0] if keys else None
    return None
