"""Where a node's ranks run: each rank on its own cores, and on a machine of several
NUMA nodes on one node's cores with its memory bound there, so a rank's weights and KV sit next
to the cores that read them. The machine's layout is read from sysfs; on one NUMA node the
memory policy is left alone (binding it would change nothing).

A node of one rank is left where the OS puts it unless `rank_cpus` names its cores: pinning it
to one NUMA node of several would take cores from it; so is a rank alone on its host
(`rank_hosts`). The ranks that share a host share its cores."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from control.errors import ConfigError

log = logging.getLogger(__name__)

SYSFS_NODES = Path("/sys/devices/system/node")
MPOL_BIND = 2
SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}  # the syscall's number, by architecture


def parse_cpu_list(text: str) -> list[int]:
    """Linux's list format ("0-3,8,10-11") -> sorted cpu numbers; ConfigError when malformed."""
    cpus: set[int] = set()
    try:
        for part in text.strip().split(","):
            first, _, last = part.strip().partition("-")
            lo, hi = int(first), int(last or first)
            if lo < 0 or hi < lo:
                raise ValueError(part)
            cpus.update(range(lo, hi + 1))
    except ValueError:
        raise ConfigError(f'{text!r} is not a cpu list (such as "0-3,8")') from None
    return sorted(cpus)


def numa_nodes(sysfs: Path = SYSFS_NODES) -> dict[int, list[int]]:
    """NUMA node -> its cpus, from sysfs (one node holding every cpu where sysfs has none)."""
    nodes = {}
    for entry in sorted(sysfs.glob("node[0-9]*")) if sysfs.is_dir() else []:
        cpulist = (entry / "cpulist").read_text().strip()
        nodes[int(entry.name[4:])] = parse_cpu_list(cpulist) if cpulist else []
    return nodes or {0: sorted(os.sched_getaffinity(0))}


@dataclass(frozen=True)
class Placement:
    cpus: list[int]
    numa_node: int | None  # the node its memory is bound to (None: not bound)


def plan_rank(
    rank: int,
    world: int,
    allowed: list[int],
    nodes: dict[int, list[int]],
    explicit: tuple[str, ...] = (),
) -> Placement:
    """Rank `rank` of `world`'s cores among `allowed` (this process's): `explicit[rank]` when
    given; else on several NUMA nodes rank r goes to the r-th node (round robin over the nodes
    that hold allowed cores), sharing it evenly with the other ranks sent there; on one node
    the allowed cores split evenly (ranks share cores only when there are fewer than ranks)."""
    by_node = {n: [c for c in cpus if c in allowed] for n, cpus in sorted(nodes.items())}
    by_node = {n: cpus for n, cpus in by_node.items() if cpus}
    if explicit:
        cpus = parse_cpu_list(explicit[rank])
        home = [n for n, node_cpus in by_node.items() if set(cpus) <= set(node_cpus)]
        return Placement(cpus, home[0] if len(by_node) > 1 and home else None)
    if len(by_node) > 1:
        names = list(by_node)
        node = names[rank % len(names)]
        sharing = [r for r in range(world) if r % len(names) == rank % len(names)]
        return Placement(_share(by_node[node], sharing.index(rank), len(sharing)), node)
    return Placement(_share(sorted(allowed), rank, world), None)


def _share(cpus: list[int], index: int, count: int) -> list[int]:
    """The index-th of `count` even, contiguous shares of `cpus` (one cpu each, round robin,
    when there are fewer cpus than shares)."""
    if len(cpus) < count:
        return [cpus[index % len(cpus)]]
    base, extra = divmod(len(cpus), count)
    start = index * base + min(index, extra)
    return cpus[start : start + base + (1 if index < extra else 0)]


def place_rank(node_cfg, rank: int) -> Placement | None:
    """Pins this process (rank `rank` of the prefill node `node_cfg`) by its `pin` and
    `rank_cpus`, before the model loads (its threads and pages follow); None when left to the
    OS. Call it before any thread pool starts: threads made later inherit the mask."""
    hosts = node_cfg.hosts_of_ranks
    here = [r for r in range(node_cfg.ranks) if hosts[r] == hosts[rank]]  # ranks on this host
    if node_cfg.pin == "off" or (len(here) == 1 and not node_cfg.rank_cpus):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if node_cfg.rank_cpus:  # (indexed by rank, whichever host it is on)
        placement = plan_rank(rank, node_cfg.ranks, allowed, numa_nodes(), node_cfg.rank_cpus)
    else:
        placement = plan_rank(here.index(rank), len(here), allowed, numa_nodes())
    try:
        os.sched_setaffinity(0, placement.cpus)
    except OSError as exc:
        raise ConfigError(
            f"node {node_cfg.name}: rank {rank} cannot run on cpus {placement.cpus}: {exc.strerror}"
        ) from None
    if placement.numa_node is not None:
        bind_memory(placement.numa_node)
    if node_cfg.threads > len(placement.cpus):
        log.warning("rank %d: %d threads on %d cores", rank, node_cfg.threads, len(placement.cpus))
    log.info(
        "rank %d on cpus %s, memory %s",
        rank,
        placement.cpus,
        "anywhere" if placement.numa_node is None else f"on node {placement.numa_node}",
    )
    return placement


_BOUND_NODE: int | None = None  # the node bind_memory bound this process to


def bound_node() -> int | None:
    """The NUMA node this process's memory is bound to (`bind_memory`), None when unbound: a
    bound process maps its own node's copy of the weights (`model.pack_cache.local_copy`)."""
    return _BOUND_NODE


def bind_memory(numa_node: int) -> None:
    """set_mempolicy(MPOL_BIND, {numa_node}): this process's later pages come from that node
    (a warning where the architecture's syscall number is not known here)."""
    number = SYS_SET_MEMPOLICY.get(platform.machine())
    if number is None:
        log.warning(
            "memory not bound to node %d: no set_mempolicy on %s", numa_node, platform.machine()
        )
        return
    words = numa_node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[numa_node // 64] = 1 << (numa_node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    # maxnode: the kernel reads one bit fewer than it is given (set_mempolicy(2), BUGS)
    if libc.syscall(number, MPOL_BIND, mask, ctypes.c_ulong(words * 64 + 1)) != 0:
        err = ctypes.get_errno()
        raise ConfigError(f"cannot bind memory to NUMA node {numa_node}: {os.strerror(err)}")
    global _BOUND_NODE
    _BOUND_NODE = numa_node
