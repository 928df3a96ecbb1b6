"""Rank 0's watchdog of a tensor-parallel prefill node (`prefill_node.ranks.RankWatchdog`): a
rank that dies is found and the shared-memory collectives are aborted, so a rank waiting in
one (here for a peer that will never come, with a minute's timeout) is released at once with
the abort's error; exits after `stop` are expected and abort nothing."""

import subprocess
import sys
import threading

import torch

from native import _C
from prefill_node.ranks import RankWatchdog


def _child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_a_dead_rank_aborts_the_collectives_and_frees_the_waiting_ranks(tmp_path):
    path = str(tmp_path / "segment")
    rank0 = _C.ShmAllReduce(path, 0, 3, 16, True, 60.0)
    rank1 = _C.ShmAllReduce(path, 1, 3, 16, False, 60.0)  # rank 2 never comes
    errors = []

    def wait():
        try:
            rank1.all_reduce(torch.ones(4).data_ptr(), 4)
        except RuntimeError as exc:
            errors.append(str(exc))

    waiter = threading.Thread(target=wait)
    waiter.start()
    children = [_child(), _child()]
    watchdog = RankWatchdog(children, rank0.abort)
    watchdog.start()
    try:
        assert not errors and waiter.is_alive()  # only the abort can end the wait now
        children[1].kill()
        waiter.join(30)
        assert not waiter.is_alive()
        assert errors == ["shm all-reduce: rank 1: the group was aborted (a peer rank died)"]
        assert watchdog.finding == "prefill rank 2 exited with status -9"
    finally:
        for proc in children:
            proc.kill()
            proc.wait()


def test_exits_after_stop_are_expected():
    aborted = []
    children = [_child()]
    watchdog = RankWatchdog(children, lambda: aborted.append(True))
    watchdog.start()
    watchdog.stop()
    watchdog._thread.join(10)
    children[0].kill()
    children[0].wait()
    assert not watchdog._thread.is_alive()
    assert watchdog.finding == "" and aborted == []
