"""ZeroMQ CURVE on every inter-node socket: one cluster key pair, one ZAP check per context.

Every process of a cluster holds the same key pair (`duet keygen DIR` writes it; `duet up` makes
a fresh one at every start). On each link the binding side (a node's control PULL, a decode
node's KV ROUTER, the router's PULL) is the CURVE server with the cluster secret key; the
connecting side is a CURVE client whose server key is the cluster public key and whose own key
pair is the cluster pair. A ZAP handler on every context that holds a server socket admits only
the cluster public key, and server sockets enforce ZAP (no handler: no handshake), so a peer with
another key pair is refused and a peer without CURVE cannot finish a handshake: none of its
frames ever reaches the socket.

Config, `[security]`: `curve_key_file` (a relative path resolves against the directory of the
config file it came from; against the working directory when there is no file), or
`insecure = true` (plain TCP; every process logs a warning at start). Neither is a ConfigError.

Key file (the czmq / pyzmq secret-certificate layout: `zmq.auth.load_certificate` reads it too),
mode 0600:

    metadata
    curve
        public-key = "<40 z85 characters>"
        secret-key = "<40 z85 characters>"
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

from control.cluster_config import SecurityConfig
from control.errors import ConfigError

log = logging.getLogger(__name__)

KEY_FILE_NAME = "cluster.key"  # what `duet keygen` and `duet up` write
ZAP_DOMAIN = "duet"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)
_ZAP_POLL_MS = 50  # how often the handler looks at its stop flag
FIX = "run `duet keygen DIR` and set [security] curve_key_file, or set insecure = true"
_KEY_LINE = re.compile(r'^\s*(public|secret)-key\s*=\s*"([^"]*)"\s*$')


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE key pair, each key 40 bytes of z85 text."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


# ---- the key file ----------------------------------------------------------------------------
def write_key_file(path: str | Path, keys: CurveKeys | None = None, *, force: bool = False):
    """Writes `keys` (a fresh pair if None) to `path` with mode 0600 and returns them.
    ConfigError if the file exists and not `force` (a replaced file is swapped in whole)."""
    path = Path(path)
    keys = keys or CurveKeys.generate()
    text = (
        "#   duet-serve cluster key pair (ZeroMQ CURVE). Keep it secret: every holder can\n"
        "#   join and control the cluster. Written by `duet keygen`.\n\n"
        "metadata\ncurve\n"
        f'    public-key = "{keys.public.decode()}"\n'
        f'    secret-key = "{keys.secret.decode()}"\n'
    )
    target = path.with_name(path.name + ".tmp") if force else path
    try:
        if force:
            target.unlink(missing_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path}: already exists (pass --force to replace it)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write the key file ({exc.strerror})") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)
    if force:
        os.replace(target, path)
    return keys


def read_key_file(path: str | Path) -> CurveKeys:
    """The key pair in `path`; ConfigError naming the file if it is missing, unreadable,
    malformed, or its public key is not the secret key's."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ConfigError(f"{path}: cannot read the CURVE key file ({why}); {FIX}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a CURVE key file (not text); {FIX}") from None
    found: dict[str, bytes] = {}
    for line in text.splitlines():
        m = _KEY_LINE.match(line)
        if m:
            found[m.group(1)] = m.group(2).encode()
    if set(found) != {"public", "secret"}:
        raise ConfigError(f"{path}: not a CURVE key file (needs public-key and secret-key lines)")
    try:  # the public key must be the secret key's: catches a truncated or mixed-up file
        is_pair = zmq.curve_public(found["secret"]) == found["public"]
    except (ValueError, zmq.ZMQError):
        is_pair = False
    if not is_pair:
        raise ConfigError(f"{path}: corrupt CURVE key file (bad or mismatched keys)")
    if path.stat().st_mode & 0o077:
        log.warning("%s: the cluster key file is readable by others (chmod 600 it)", path)
    return CurveKeys(found["public"], found["secret"])


# ---- sockets ---------------------------------------------------------------------------------
class CurveSecurity:
    """The cluster key pair of one process, applied to its sockets; `None` in place of one of
    these means plain sockets (in-process tests, `insecure = true`).

    `server(sock)` before `bind`, `client(sock)` before `connect`. The first server socket of a
    context starts that context's ZAP handler (a thread; one CurveSecurity per context);
    `release(ctx)` stops it, after the context's server sockets are closed (before
    `ctx.term()`, which would otherwise wait for the handler's socket)."""

    def __init__(self, keys: CurveKeys):
        self.keys = keys
        self.num_refused = 0  # handshakes refused for an unknown key (all contexts)
        self._public_raw = z85.decode(keys.public)  # ZAP carries the client key in binary
        self._zaps: dict[int, _ZapHandler] = {}  # by the context's libzmq address
        self._lock = threading.Lock()
        self._refused_keys: set[bytes] = set()

    def server(self, sock: zmq.Socket) -> None:
        self._ensure_zap(sock.context)
        sock.curve_server = True
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never admit all

    def client(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.keys.public
        sock.curve_publickey = self.keys.public
        sock.curve_secretkey = self.keys.secret

    def release(self, ctx: zmq.Context) -> None:
        with self._lock:
            zap = self._zaps.pop(ctx.underlying, None)
        if zap is not None:
            zap.close()

    def close(self) -> None:
        with self._lock:
            zaps, self._zaps = list(self._zaps.values()), {}
        for zap in zaps:
            zap.close()

    def is_allowed(self, mechanism: bytes, credentials: list[bytes]) -> bool:
        """ZAP's question for one handshake (asked in the handler thread): only a CURVE client
        whose public key is the cluster's. CURVE itself has proven it holds the secret key."""
        if mechanism == b"CURVE" and credentials == [self._public_raw]:
            return True
        self.num_refused += 1
        key = z85.encode(credentials[0]) if len(credentials) == 1 else mechanism
        if key not in self._refused_keys and len(self._refused_keys) < 64:
            self._refused_keys.add(key)  # one warning per stranger, not one per reconnect
            log.warning("refused a ZeroMQ peer with an unknown CURVE key %s", key.decode())
        return False

    def _ensure_zap(self, ctx: zmq.Context) -> None:
        with self._lock:
            if ctx.underlying not in self._zaps:
                self._zaps[ctx.underlying] = _ZapHandler(ctx, self.is_allowed)


class _ZapHandler:
    """Answers a context's ZAP requests (RFC 27) in a thread: 200 if `is_allowed(mechanism,
    credentials)`, else 400 (libzmq then refuses the handshake)."""

    def __init__(self, ctx: zmq.Context, is_allowed):
        self._is_allowed = is_allowed
        # A sync shadow: this thread needs a plain socket even on a zmq.asyncio context.
        self._sock = zmq.Context.shadow(ctx.underlying).socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise RuntimeError(f"cannot serve ZAP on this zmq context: {exc}") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zmq-zap", daemon=True)
        self._thread.start()  # the socket belongs to the thread from here on

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if sock.poll(_ZAP_POLL_MS, zmq.POLLIN):
                    sock.send_multipart(self._reply(sock.recv_multipart()))
        except zmq.ZMQError as exc:  # the context was terminated under us
            log.error("the ZAP handler stopped: %s", exc)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.unbind(ZAP_ENDPOINT)  # at once, unlike close: a new handler may bind next
            sock.close(linger=0)

    def _reply(self, frames: list[bytes]) -> list[bytes]:
        # Request: version, request id, domain, address, identity, mechanism, credentials...
        request_id = frames[1] if len(frames) > 1 else b""
        ok = len(frames) >= 6 and frames[0] == b"1.0" and self._is_allowed(frames[5], frames[6:])
        status = [b"200", b"OK"] if ok else [b"400", b"unknown key"]
        return [b"1.0", request_id, *status, b"", b""]  # + user id, metadata


def curve_server(sock: zmq.Socket, security: CurveSecurity | None) -> None:
    """Makes `sock` a CURVE server (before bind); a no-op for plain (`security` None)."""
    if security is not None:
        security.server(sock)


def curve_client(sock: zmq.Socket, security: CurveSecurity | None) -> None:
    """Makes `sock` a CURVE client (before connect); a no-op for plain (`security` None)."""
    if security is not None:
        security.client(sock)


# ---- from the config -------------------------------------------------------------------------
def key_path(cfg: SecurityConfig, config_path: str | Path | None = None) -> Path:
    """`curve_key_file`, a relative one resolved against the config file's directory (the
    working directory without a file)."""
    path = Path(cfg.curve_key_file).expanduser()
    if not path.is_absolute() and config_path is not None:
        path = Path(config_path).resolve().parent / path
    return path.resolve()


def kv_link(
    cfg: SecurityConfig, security: CurveSecurity | None
) -> tuple[CurveSecurity | None, bool]:
    """(what the KV sockets run, whether every KV message is sealed): with kv_security = "aead"
    plain sockets and sealed messages (kvtransfer.sealing), else `security` on the sockets
    (CURVE, or None on an insecure cluster) and nothing sealed."""
    if security is not None and cfg.kv_security == "aead":
        return None, True
    return security, False


def cluster_security(
    cfg: SecurityConfig, config_path: str | Path | None = None, who: str = "this process"
) -> CurveSecurity | None:
    """What a process's sockets use: the cluster keys, or None (plain, with a warning) for
    `insecure = true`. ConfigError when the config asks for neither or the keys are bad."""
    if cfg.insecure:
        if cfg.curve_key_file:
            raise ConfigError("[security] sets both curve_key_file and insecure = true: pick one")
        log.warning(
            "[security] insecure = true: %s talks plain ZeroMQ, unauthenticated and unencrypted; "
            "anyone who reaches its ports can control the cluster",
            who,
        )
        return None
    if not cfg.curve_key_file:
        raise ConfigError(f"[security] names no curve_key_file: {FIX}")
    return CurveSecurity(read_key_file(key_path(cfg, config_path)))


def with_ephemeral_keys(
    raw: dict[str, Any], workdir: str | Path, config_path: str | Path | None = None
) -> dict[str, Any]:
    """For `duet up`: a copy of the raw config dict whose [security] names a key file. With
    neither `curve_key_file` nor `insecure` set, a fresh pair is written to
    `workdir/KEY_FILE_NAME` (the launcher's private directory; it deletes the file at exit).
    A relative `curve_key_file` is made absolute against `config_path`'s directory, since the
    config is rewritten elsewhere."""
    raw = copy.deepcopy(raw)
    section = raw.setdefault("security", {})
    if not isinstance(section, dict):
        raise ConfigError("[security] must be a table")
    if section.get("insecure") is True:
        return raw
    if section.get("curve_key_file"):
        cfg = SecurityConfig(curve_key_file=str(section["curve_key_file"]))
        section["curve_key_file"] = str(key_path(cfg, config_path))
        return raw
    path = Path(workdir) / KEY_FILE_NAME
    write_key_file(path, force=True)
    section["curve_key_file"] = str(path)
    return raw


def security_toml(path: str | Path) -> str:
    """The [security] lines that name the key file at `path`, to paste into a cluster config."""
    return f"[security]\ncurve_key_file = {json.dumps(str(Path(path).resolve()))}\n"
