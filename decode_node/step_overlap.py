"""The decode step's overlap: the loop's own work beside the forward.

With `overlap` on, a step runs its forward on the loop's thread while one helper thread does the
loop's side of the step: it emits the previous step's tokens (and the Preempted that follow
them), takes in the next step's inputs (new reservations, finished transfers, aborts, expiry,
the router's lease) and sends the heartbeat. The kernels release the GIL, so that Python work
costs the step nothing where a core is free. This is the seeds' "组 batch" overlap and SGLang's
overlap scheduler, on the loop's side: the batch of step n + 1 is only built once step n's
tokens are known, so no row runs a step too many.

The forward stays on the loop's thread (the helper runs no kernels): OpenMP keeps one thread
team per calling thread, and a second team spinning beside the first costs a 2-core host more
than the overlap saves (measured: 36 ms against 33 ms a step at batch 1 with the forward on a
worker).

What makes it safe:
- the forward reads only what `ForwardBatch` holds (its own tensors: slots, page table rows),
  never a `PageTable` or the scheduler, which the helper may change meanwhile; the loop's
  thread touches neither until the helper is done (`run` joins it);
- a request aborted (or expired, or failed) while its row is in flight has its pages freed by
  the scheduler as always, but the allocator holds them back (`PageAllocator.hold_frees`) until
  the forward is done: the row it still writes never lands in a page already lent to a new
  request's KV transfer.

Without `overlap` (and on multi-rank nodes, whose steps run in lockstep, and with MTP, whose
step is several dependent forwards) the node runs the same work in order, on one thread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

from model.kv_pool import KVPool

T = TypeVar("T")


class StepOverlap:
    def __init__(self, pool: KVPool):
        self.pool = pool
        self._helper = concurrent.futures.ThreadPoolExecutor(1, "decode-loop-side")

    def run(
        self, side: Callable[[], None], forward: Callable[[], T]
    ) -> tuple[T | None, Exception | None]:
        """`side()` on the helper while `forward()` runs here; returns (forward's result or
        None, its exception or None) once both are done (an exception of `side` is raised)."""
        self.pool.allocator.hold_frees()  # until the forward is done: it may write any row
        try:
            done = self._helper.submit(side)
            try:
                result, error = forward(), None
            except Exception as exc:
                result, error = None, exc
            done.result()
        finally:
            self.pool.allocator.release_held()
        return result, error

    def close(self) -> None:
        self._helper.shutdown(wait=True)
