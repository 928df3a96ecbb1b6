"""A private network of Linux network namespaces for multi-host tests on one machine.

`NetnsLab.create(names)` makes one namespace per name, each joined by a veth pair to one bridge
in the root namespace, on a /24 of 10.213.0.0/16 that no address or route of this machine
touches: the bridge holds `.1` (so this process, in the root namespace, reaches every
namespace), namespace i holds `.10 + i`, and each namespace's loopback is up as on a real host.
Nothing is routed off the bridge (no gateway, no forwarding): traffic never leaves the machine.
Names carry a random suffix; `close()` ends every process still in a namespace and removes
everything created, whatever state creation reached. Every `ip` call is bounded.

Needs root (CAP_NET_ADMIN) and iproute2: `NetnsUnavailable` says why not.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

IP_TIMEOUT_S = 10.0
SUBNET_PREFIX = "10.213"


class NetnsUnavailable(Exception):
    """Namespaces cannot be created here (the message says why)."""


def _ip_binary() -> str:
    path = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin:/usr/bin:/bin")
    if path is None:
        raise NetnsUnavailable("iproute2's `ip` is not installed")
    return path


@dataclass
class NetnsLab:
    ip: str  # the `ip` binary
    suffix: str
    subnet: str  # "10.213.N": addresses are f"{subnet}.{host}"
    names: list[str]
    namespaces: dict[str, str] = field(default_factory=dict)  # name -> namespace
    addresses: dict[str, str] = field(default_factory=dict)  # name -> its address
    _links: list[str] = field(default_factory=list)  # root-namespace links to delete

    @property
    def root_address(self) -> str:
        return f"{self.subnet}.1"

    @property
    def bridge(self) -> str:
        return f"dbr{self.suffix}"

    @classmethod
    def create(cls, names: list[str]) -> NetnsLab:
        ip = _ip_binary()
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (CAP_NET_ADMIN)")
        lab = cls(ip, secrets.token_hex(3), _free_subnet(ip), list(names))
        try:
            lab._build()
        except BaseException:
            lab.close()
            raise
        return lab

    def exec_prefix(self, name: str) -> list[str]:
        """The command prefix that runs a command inside `name`'s namespace."""
        return [self.ip, "netns", "exec", self.namespaces[name]]

    def pids(self, name: str) -> list[int]:
        """Every process in `name`'s namespace."""
        out = self._run("netns", "pids", self.namespaces[name], check=False)
        return [int(p) for p in out.split()]

    def close(self) -> None:
        """Ends every process in the namespaces (SIGKILL), deletes namespaces, veths, bridge."""
        for name in list(self.namespaces):
            for pid in self.pids(name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + IP_TIMEOUT_S
        while any(self.pids(n) for n in self.namespaces) and time.monotonic() < deadline:
            time.sleep(0.05)
        for ns in self.namespaces.values():
            self._run("netns", "del", ns, check=False)
        for link in reversed(self._links):  # a veth whose peer's namespace is gone is gone too
            if Path(f"/sys/class/net/{link}").exists():
                self._run("link", "del", link, check=False)
        self.namespaces.clear()
        self._links.clear()

    # ---- building --------------------------------------------------------------------------
    def _build(self) -> None:
        # The first namespace and the bridge show whether this machine allows any of it.
        for i, name in enumerate(self.names):
            ns = f"duet-{self.suffix}-{i}"
            self._run_or_unavailable(i == 0, "netns", "add", ns)
            self.namespaces[name] = ns
        self._run_or_unavailable(True, "link", "add", self.bridge, "type", "bridge")
        self._links.append(self.bridge)
        self._run("addr", "add", f"{self.root_address}/24", "dev", self.bridge)
        self._run("link", "set", self.bridge, "up")
        for i, (name, ns) in enumerate(self.namespaces.items()):
            outer, inner = f"dv{self.suffix}{i}", f"dp{self.suffix}{i}"
            self._run("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._links.append(outer)
            self._run("link", "set", inner, "netns", ns)
            self._run("link", "set", outer, "master", self.bridge)
            self._run("link", "set", outer, "up")
            address = f"{self.subnet}.{10 + i}"
            self._run("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
            self._run("-n", ns, "link", "set", inner, "up")
            self._run("-n", ns, "link", "set", "lo", "up")
            self.addresses[name] = address

    def _run_or_unavailable(self, is_probe: bool, *args: str) -> None:
        try:
            self._run(*args)
        except subprocess.CalledProcessError as exc:
            if is_probe:
                why = exc.stderr.strip() or f"exit status {exc.returncode}"
                raise NetnsUnavailable(f"`ip {' '.join(args[:2])}` failed: {why}") from None
            raise

    def _run(self, *args: str, check: bool = True) -> str:
        """`ip ARGS`'s output; with `check=False` (cleaning up) a failure or a hang is ""."""
        cmd = [self.ip, *args]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            if check:
                raise
            return ""
        if check and r.returncode != 0:
            raise subprocess.CalledProcessError(r.returncode, cmd, r.stdout, r.stderr)
        return r.stdout


def _free_subnet(ip: str) -> str:
    """A "10.213.N" that no address or route of the root namespace mentions."""
    taken = subprocess.run(
        [ip, "-o", "addr"], capture_output=True, text=True, timeout=IP_TIMEOUT_S
    ).stdout
    taken += subprocess.run(
        [ip, "route"], capture_output=True, text=True, timeout=IP_TIMEOUT_S
    ).stdout
    candidates = list(range(16, 250))
    random.shuffle(candidates)
    for n in candidates:
        if f"{SUBNET_PREFIX}.{n}." not in taken:
            return f"{SUBNET_PREFIX}.{n}"
    raise NetnsUnavailable(f"no free /24 in {SUBNET_PREFIX}.0.0/16")


# ---- reading a namespace's listening sockets ------------------------------------------------
def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in the network namespace of `pid` (read
    from /proc/PID/net/tcp and tcp6, which show that namespace). IPv6 addresses are written
    compressed, "::" for the wildcard."""
    import ipaddress

    found = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # the kernel prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            addr = ipaddress.ip_address(words)
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
                addr = addr.ipv4_mapped
            found.add((str(addr), int(hex_port, 16)))
    return found
