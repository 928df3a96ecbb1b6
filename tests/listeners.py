"""The TCP sockets a process listens on, read from /proc (tests that check which addresses a
role or rank binds)."""

from pathlib import Path


def listening_sockets(pid: int | str = "self") -> set[tuple[str, int]]:
    """(IPv4 address, port) of the TCP sockets process `pid` listens on (IPv6 ones as "v6")."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # TCP_LISTEN, one of its own
                continue
            hex_addr, hex_port = fields[1].split(":")
            addr = (
                ".".join(str(b) for b in bytes.fromhex(hex_addr)[::-1]) if table == "tcp" else "v6"
            )
            found.add((addr, int(hex_port, 16)))
    return found
