"""`duet up`: run a whole cluster on this machine, every role a child process.

    duet up --config FILE [--model DIR] [--port P] [--dtype D]
    duet up [--model DIR] [--prefill N] [--decode M] [--port P] [--dtype float32|bfloat16]
    duet up ... [--decode-ranks R]   (every decode node runs R ranks: EP/DP)
    duet up ... [--prefill-ranks R]  (every prefill node runs R ranks: tensor parallel)
    duet up ... [--routers N]        (N routers in front of the same nodes: ports P, P+1, ...)

The shorthand builds a config with N prefill and M decode nodes on free loopback ports. Either
way the resolved config (model path filled in: with no model, the built-in tiny model, made once)
is written to a temporary file, and each role is started through its launch script
(`deploy/launch_*.sh`), exactly as on separate hosts. The launcher waits until the router's
/health shows every node ready, prints the URL, then supervises: a child that dies (crash,
SIGKILL, a drained node exiting) is started again with backoff while the others keep serving
(`deploy.supervisor`). Ctrl-C / SIGTERM stops every child (SIGINT, then SIGKILL after a grace
period). A child that dies before the cluster was ever ready stops everything (a bad config or
model would only die again).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from control.cluster_config import (
    KV_SECURITY_MODES,
    REASONING_PARSERS,
    TOOL_PARSERS,
    ClusterConfig,
)
from control.errors import ConfigError
from control.quant_schemes import QUANT_SCHEMES
from control.security import KEY_FILE_NAME, with_ephemeral_keys
from deploy.supervisor import Supervisor

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL
POLL_S = 0.2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="duet up", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="cluster config (TOML); else the shorthand options below")
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--prefill", type=int, help="number of prefill nodes (shorthand; default 1)")
    p.add_argument("--decode", type=int, help="number of decode nodes (shorthand; default 1)")
    p.add_argument("--port", type=int, help="the router's HTTP port (default 8000)")
    p.add_argument(
        "--routers",
        type=int,
        help="routers in front of the same nodes ([router] replicas): HTTP on --port, "
        "--port + 1, ...; each serves on when another dies",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="default bfloat16")
    p.add_argument("--threads", type=int, default=1, help="threads per node (shorthand)")
    p.add_argument("--decode-ranks", type=int, help="processes per decode node (EP/DP layout)")
    p.add_argument("--prefill-ranks", type=int, help="processes per prefill node (tensor parallel)")
    p.add_argument(
        "--prefill-quant", choices=QUANT_SCHEMES, help="every prefill node's weight quantization"
    )
    p.add_argument(
        "--decode-quant", choices=QUANT_SCHEMES, help="every decode node's weight quantization"
    )
    p.add_argument(
        "--quant-lm-head",
        action="store_true",
        help="every node runs its LM head in int8 W8A8, whatever its weight quantization",
    )
    p.add_argument(
        "--quant-attention",
        choices=QUANT_SCHEMES,
        help="every node's attention projections' scheme (default: each node's quant's own)",
    )
    p.add_argument(
        "--mtp-tokens",
        type=int,
        help="every decode node speculates with the model's MTP layer, this many drafts a step",
    )
    p.add_argument(
        "--no-weights-cache",
        action="store_true",
        help="every node reads the checkpoint into its heap (no packed weights built or mapped)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="the router splits chat output into reasoning_content and content",
    )
    p.add_argument(
        "--tool-parser",
        choices=TOOL_PARSERS,
        help="the format the model writes tool calls in (chat tools are refused without one)",
    )
    p.add_argument(
        "--kv-security",
        choices=KV_SECURITY_MODES,
        help="the KV links: curve (CURVE sockets, the default) or aead (plain sockets, every KV "
        "message sealed with AES-256-GCM under a key per transfer)",
    )
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="the router starts and drains nodes within the config's [autoscale] bounds",
    )
    p.add_argument(
        "--decode-prefix-cache",
        action="store_true",
        help="decode nodes keep finished prompts' KV (prefix_cache = true): a later prompt "
        "starting with one receives only the rest (multi-turn chat)",
    )
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait")
    return p.parse_args(argv)


# ---- the config ----------------------------------------------------------------------------
def free_ports(
    count: int, host: str = "127.0.0.1", exclude: frozenset[int] = frozenset()
) -> list[int]:
    """`count` distinct free ports, none in `exclude`: every socket stays bound until all are
    picked, so the OS cannot hand out the same port twice (picking one at a time sometimes did)."""
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < count:
            s = socket.socket()
            s.bind((host, 0))
            if s.getsockname()[1] in exclude:
                s.close()
                continue
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def free_port_run(count: int, exclude: frozenset[int] = frozenset()) -> int:
    """The first of `count` consecutive free ports, none in `exclude` (router replica i's
    control port is the first + i)."""
    for _ in range(100):
        first = free_ports(1, exclude=exclude)[0]
        run = range(first, first + count)
        if run[-1] < 65536 and not exclude & set(run) and all(map(_is_free, run)):
            return first
    raise ConfigError(f"found no {count} consecutive free ports")


def _is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def shorthand_config(
    num_prefill: int, num_decode: int, port: int, threads: int, routers: int = 1
) -> dict:
    """A config dict: N prefill and M decode nodes, their control/KV ports picked free (and
    `routers` consecutive control ports for the routers)."""
    if num_prefill < 1 or num_decode < 1:
        raise ConfigError("--prefill and --decode must be at least 1")
    http = frozenset(range(port, port + routers))
    control = free_port_run(routers, exclude=http)
    taken = http | frozenset(range(control, control + routers))
    ports = iter(free_ports(num_prefill + 2 * num_decode, exclude=taken))
    return {
        "router": {"host": "127.0.0.1", "port": port, "control_port": control,
                   "replicas": routers},
        "prefill": [
            {"name": f"prefill-{i}", "control_port": next(ports), "threads": threads}
            for i in range(num_prefill)
        ],
        "decode": [
            {"name": f"decode-{i}", "control_port": next(ports), "kv_port": next(ports),
             "threads": threads}
            for i in range(num_decode)
        ],
    }  # fmt: skip


def resolve_config(args: argparse.Namespace) -> dict:
    """The raw config dict to run: the file or the shorthand, with the overrides applied and the
    model path resolved. Validated with ClusterConfig (ConfigError on anything wrong)."""
    if args.config:
        if args.prefill is not None or args.decode is not None:
            raise ConfigError("--prefill/--decode build a config: not with --config")
        try:
            raw = tomllib.loads(Path(args.config).read_text())
        except OSError as exc:
            raise ConfigError(f"{args.config}: cannot read ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{args.config}: invalid TOML ({exc})") from None
        if args.port is not None:
            raw.setdefault("router", {})["port"] = args.port
        if args.routers is not None:
            raw.setdefault("router", {})["replicas"] = args.routers
    else:
        port = 8000 if args.port is None else args.port
        num_prefill = 1 if args.prefill is None else args.prefill
        num_decode = 1 if args.decode is None else args.decode
        routers = 1 if args.routers is None else args.routers
        raw = shorthand_config(num_prefill, num_decode, port, args.threads, routers)
    for role, ranks in (("decode", args.decode_ranks), ("prefill", args.prefill_ranks)):
        if ranks is not None:  # each rank runs `threads` kernel threads
            for node in raw.get(role, []):
                node["ranks"] = ranks
    for role, quant in (("prefill", args.prefill_quant), ("decode", args.decode_quant)):
        if quant is not None:  # overrides the config's per-node `quant`
            for node in raw.get(role, []):
                node["quant"] = quant
    if args.quant_attention is not None:  # overrides the config's per-node `quant_attention`
        for node in (*raw.get("prefill", []), *raw.get("decode", [])):
            node["quant_attention"] = args.quant_attention
    if args.quant_lm_head:  # overrides the config's per-node `quant_lm_head`
        for node in (*raw.get("prefill", []), *raw.get("decode", [])):
            node["quant_lm_head"] = True
    if args.no_weights_cache:  # overrides the config's per-node `weights_cache`
        for node in (*raw.get("prefill", []), *raw.get("decode", [])):
            node["weights_cache"] = False
    if args.mtp_tokens is not None:  # overrides the config's per-node `mtp` / `mtp_tokens`
        for node in raw.get("decode", []):
            node.update(mtp=args.mtp_tokens > 0, mtp_tokens=max(1, args.mtp_tokens))
    for key in ("reasoning_parser", "tool_parser"):
        if getattr(args, key):
            raw.setdefault("router", {})[key] = getattr(args, key)
    if args.kv_security:
        raw.setdefault("security", {})["kv_security"] = args.kv_security
    if args.autoscale:
        raw.setdefault("autoscale", {})["enabled"] = True
    if args.decode_prefix_cache:  # overrides the config's per-node `prefix_cache` (decode)
        for node in raw.get("decode", []):
            node["prefix_cache"] = True
    if args.dtype:
        raw["dtype"] = args.dtype
    if args.model:
        raw["model"] = str(Path(args.model).resolve())
    ClusterConfig.from_dict(raw)  # validate before spending time on the model
    if not raw.get("model"):
        from control.builtin_model import ensure_builtin_model

        raw["model"] = str(ensure_builtin_model())
    elif not Path(raw["model"]).is_dir():
        raise ConfigError(f"model directory {raw['model']!r} does not exist")
    return raw


def dump_toml(raw: dict[str, Any]) -> str:
    """TOML text of a config dict (scalars, tables of scalars and of lists of scalars, arrays
    of such tables)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)  # JSON string escapes are valid TOML basic-string escapes
        if isinstance(v, (list, tuple)) and not any(isinstance(x, (dict, list)) for x in v):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise ConfigError(f"cannot write {v!r} to TOML")

    lines = [f"{k} = {value(v)}" for k, v in raw.items() if not isinstance(v, (dict, list))]
    for key, table in raw.items():
        if isinstance(table, dict):
            lines += ["", f"[{key}]", *(f"{k} = {value(v)}" for k, v in table.items())]
        elif isinstance(table, list):
            for entry in table:
                lines += ["", f"[[{key}]]", *(f"{k} = {value(v)}" for k, v in entry.items())]
    return "\n".join(lines) + "\n"


# ---- the children --------------------------------------------------------------------------
def _die_with_parent() -> None:
    """In the child before exec: its own session (a terminal's Ctrl-C reaches only the launcher,
    which stops the children in order) and SIGINT (stop now) if the launcher dies uncleanly."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the launcher's own cleanup still applies


class Cluster:
    def __init__(self, config_path: Path, cfg: ClusterConfig):
        self.config_path = config_path
        self.cfg = cfg
        env = {**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
        self.children = Supervisor(env, preexec_fn=_die_with_parent)
        replicas = [cfg.router.for_replica(i) for i in range(cfg.router.replicas)]
        self.urls = [f"http://{r.host}:{r.port}" for r in replicas]
        self.url = self.urls[0]

    def start(self) -> None:
        roles = [("router", "launch_router.sh", [])]
        roles += [
            (f"router-{i}", "launch_router.sh", ["--replica", str(i)])
            for i in range(1, len(self.urls))
        ]
        roles += [(p.name, "launch_prefill.sh", [p.name]) for p in self.cfg.prefill]
        roles += [(d.name, "launch_decode.sh", [d.name]) for d in self.cfg.decode]
        for name, script, extra in roles:
            cmd = ["bash", str(HERE / script), str(self.config_path), *extra]
            # uvicorn stops cleanly on SIGTERM; a node drains on SIGTERM, so it gets SIGINT
            stop = signal.SIGTERM if name.startswith("router") else signal.SIGINT
            self.children.start(name, cmd, stop)

    def exited(self) -> list[tuple[str, int]]:
        return self.children.exited()

    def health(self, url: str | None = None) -> dict | None:
        """A router's /health body (the first router's by default); None if it does not
        answer."""
        try:
            with urllib.request.urlopen((url or self.url) + "/health", timeout=2) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:  # 503 while starting still carries the body
            try:
                return json.loads(exc.read())
            except ValueError:
                return None
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        self.children.stop(STOP_GRACE_S)


class _Stop(Exception):
    pass


def _wait_ready(cluster: Cluster, timeout_s: float, stopping: list[int]) -> None:
    """Until every router sees every node ready; ConfigError if a child exits, a node fails, or
    time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stopping:
            raise _Stop
        if cluster.exited():
            name, code = cluster.exited()[0]
            raise ConfigError(f"{name} exited with status {code} while starting")
        ready = 0
        for url in cluster.urls:
            nodes = (cluster.health(url) or {}).get("nodes", {})
            failed = {n: s.get("error", "") for n, s in nodes.items() if s.get("status") == "dead"}
            if failed:
                name, error = next(iter(failed.items()))
                raise ConfigError(f"node {name} failed to start: {error}")
            ready += bool(nodes) and all(s.get("status") == "ready" for s in nodes.values())
        if ready == len(cluster.urls):
            return
        time.sleep(POLL_S)
    raise ConfigError(f"the cluster was not ready after {timeout_s:g} s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raw = resolve_config(args)
    cfg = ClusterConfig.from_dict(raw)
    workdir = Path(tempfile.mkdtemp(prefix="duet-up-"))
    config_path = workdir / "cluster.toml"
    raw = with_ephemeral_keys(raw, workdir, args.config)  # a fresh CURVE key pair per start
    config_path.write_text(dump_toml(raw))
    cluster = Cluster(config_path, cfg)
    print(f"duet up: {cfg.ratio} cluster, config {config_path}", flush=True)

    stopping: list[int] = []
    previous = {
        s: signal.signal(s, lambda n, f: stopping.append(n))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    status = 0
    try:
        cluster.start()
        _wait_ready(cluster, args.ready_timeout, stopping)
        print(
            f"duet up: ready at {cluster.url}/v1 ({cfg.ratio}, {cfg.dtype}, model {cfg.model}); "
            "Ctrl-C stops it",
            flush=True,
        )
        for i, url in enumerate(cluster.urls[1:], 1):
            print(f"duet up: router {i} at {url}/v1", flush=True)
        while not stopping:  # supervise: a child that dies is restarted, the rest keep serving
            cluster.children.poll()
            time.sleep(POLL_S)
    except _Stop:
        pass
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        status = 1
    finally:
        print("duet up: stopping", flush=True)
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        config_path.unlink(missing_ok=True)
        (workdir / KEY_FILE_NAME).unlink(missing_ok=True)
        workdir.rmdir()
    return status


if __name__ == "__main__":
    sys.exit(main())
