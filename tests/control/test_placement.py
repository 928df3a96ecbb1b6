"""Where a prefill node's ranks run (`control.placement`): the cpu-list format, the
NUMA layout read from a sysfs tree, each rank's cores on one and on several NUMA nodes (and
with `rank_cpus`), and the real calls in a child process: its affinity set, and on this machine
(node 0 exists everywhere) its memory bound to node 0, as /proc's numa_maps shows."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from control.cluster_config import PrefillNodeConfig
from control.errors import ConfigError
from control.placement import (
    Placement,
    bind_memory,
    numa_nodes,
    parse_cpu_list,
    place_rank,
    plan_rank,
)


def test_the_cpu_list_format():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list(" 5 ") == [5]
    for bad in ("", "a", "3-1", "1,,2", "-1"):
        with pytest.raises(ConfigError, match="not a cpu list"):
            parse_cpu_list(bad)


def test_the_numa_layout_comes_from_sysfs(tmp_path):
    for node, cpus in ((0, "0-3"), (1, "4-7"), (2, "")):  # node 2: memory only
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-2\n")  # not a node directory
    assert numa_nodes(tmp_path) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7], 2: []}
    # No sysfs tree: one node holding the cores this process may use.
    assert numa_nodes(tmp_path / "missing") == {0: sorted(os.sched_getaffinity(0))}


def test_on_one_node_the_allowed_cores_split_evenly():
    one = {0: list(range(8))}
    assert [plan_rank(r, 2, [0, 1, 2, 3, 4], one) for r in range(2)] == [
        Placement([0, 1, 2], None),
        Placement([3, 4], None),
    ]
    # Fewer cores than ranks: one core each, round robin; memory never bound on one node.
    assert [plan_rank(r, 3, [6, 7], one).cpus for r in range(3)] == [[6], [7], [6]]


def test_on_several_nodes_each_rank_goes_to_a_node_and_binds_its_memory_there():
    two = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    allowed = list(range(8))
    assert [plan_rank(r, 2, allowed, two) for r in range(2)] == [
        Placement([0, 1, 2, 3], 0),
        Placement([4, 5, 6, 7], 1),
    ]
    # Four ranks on two nodes: two a node, sharing its cores.
    assert [plan_rank(r, 4, allowed, two) for r in range(4)] == [
        Placement([0, 1], 0),
        Placement([4, 5], 1),
        Placement([2, 3], 0),
        Placement([6, 7], 1),
    ]
    # A node with none of this process's cores takes no rank.
    assert plan_rank(1, 2, [0, 1, 2, 3], two) == Placement([2, 3], None)


def test_rank_cpus_name_each_ranks_cores():
    two = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    explicit = ("0-1", "4,5", "3-4")
    assert plan_rank(0, 3, list(range(8)), two, explicit) == Placement([0, 1], 0)
    assert plan_rank(1, 3, list(range(8)), two, explicit) == Placement([4, 5], 1)
    assert plan_rank(2, 3, list(range(8)), two, explicit) == Placement([3, 4], None)  # 2 nodes
    assert plan_rank(0, 1, [0, 1], {0: [0, 1]}, ("1",)) == Placement([1], None)


def _child(queue, cfg, rank, bind):
    try:
        placement = place_rank(cfg, rank)
        if bind:
            bind_memory(0)
        policies = {
            line.split()[1] for line in Path("/proc/self/numa_maps").read_text().splitlines()
        }
        queue.put((placement, sorted(os.sched_getaffinity(0)), policies))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        queue.put(exc)


def _in_child(cfg, rank=0, bind=False):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, cfg, rank, bind))
    proc.start()
    result = queue.get(timeout=60)
    proc.join(30)
    if isinstance(result, Exception):
        raise result
    return result


def test_a_rank_is_pinned_to_its_share_and_one_rank_or_off_is_left_alone():
    allowed = sorted(os.sched_getaffinity(0))
    two = PrefillNodeConfig(name="p", ranks=2)
    placement, affinity, _ = _in_child(two, rank=1)
    assert affinity == placement.cpus == plan_rank(1, 2, allowed, numa_nodes()).cpus
    assert _in_child(PrefillNodeConfig(name="p"))[:2] == (None, allowed)
    assert _in_child(PrefillNodeConfig(name="p", ranks=2, pin="off"))[:2] == (None, allowed)
    pinned, affinity, _ = _in_child(PrefillNodeConfig(name="p", rank_cpus=(str(allowed[-1]),)))
    assert affinity == pinned.cpus == [allowed[-1]]


@pytest.mark.skipif(not Path("/proc/self/numa_maps").exists(), reason="no numa_maps here")
def test_memory_bound_to_node_0_is_the_policy_of_the_process():
    *_, policies = _in_child(PrefillNodeConfig(name="p"), bind=True)
    assert "bind:0" in policies  # the mappings that follow the process's policy
    *_, policies = _in_child(PrefillNodeConfig(name="p"))
    assert "bind:0" not in policies


def test_ranks_on_other_hosts_share_only_their_own_hosts_cores():
    """rank_hosts: a rank alone on its host is left to the OS; ranks that share a host split
    its cores as the ranks of one machine do."""
    allowed = sorted(os.sched_getaffinity(0))
    alone = PrefillNodeConfig(name="p", ranks=2, rank_hosts=("10.0.0.9",))
    assert _in_child(alone, rank=1)[:2] == (None, allowed)
    shared = PrefillNodeConfig(name="p", ranks=3, rank_hosts=("10.0.0.9", "10.0.0.9"))
    placement, affinity, _ = _in_child(shared, rank=2)
    assert affinity == placement.cpus == plan_rank(1, 2, allowed, numa_nodes()).cpus
    assert _in_child(shared, rank=0)[:2] == (None, allowed)  # rank 0 alone on 127.0.0.1
