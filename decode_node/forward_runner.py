"""The decode step's forward, run beside the node's loop (issue 12: the overlapped step).

With `overlap` on, `start` hands the step's forward to one worker thread and returns at once;
the loop then emits the previous step's tokens and takes in the next step's inputs (new
reservations, finished transfers, aborts, expiry) while the kernels run (they release the GIL),
and `wait` takes the logits. This is the seeds' "组 batch" overlap and SGLang's overlap
scheduler, on the loop's side: the batch of step n + 1 is only built once step n's tokens are
known, so no row runs a step too many.

What makes it safe:
- the forward reads only what `ForwardBatch` holds (its own tensors: slots, page table rows),
  never a `PageTable` or the scheduler, so the loop may change those meanwhile;
- a request aborted (or expired, or failed) while its row is in flight has its pages freed by
  the scheduler as always, but the allocator holds them back (`PageAllocator.hold_frees`) until
  the forward is done: the row it still writes never lands in a page already lent to a new
  request's KV transfer;
- the worker sets the kernels' thread count itself: OpenMP's count is per calling thread.

Without `overlap` (and on multi-rank nodes, whose steps run in lockstep, and with MTP, whose
step is several dependent forwards) `start` runs the forward at once, on the loop's thread.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.batch import ForwardBatch
from engine.kv_pool import KVPool
from engine.model import DeepseekModel
from native import ops


@dataclass
class InFlight:
    """A step whose forward was started: its batch (requests, in row order), the logits to
    come, the structured rows' masks (computed beside it) and when it started."""

    batch: list[Any]
    logits: concurrent.futures.Future[torch.Tensor]
    masks: concurrent.futures.Future[Any]
    started: float


class ForwardRunner:
    def __init__(self, model: DeepseekModel, pool: KVPool, background: bool):
        self.model = model
        self.pool = pool
        self.background = background
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        if background:
            threads = torch.get_num_threads()
            self._worker = concurrent.futures.ThreadPoolExecutor(
                1, "decode-forward", initializer=ops.set_num_threads, initargs=(threads,)
            )

    def start(
        self, fb: ForwardBatch, batch: list[Any], masks: concurrent.futures.Future[Any]
    ) -> InFlight:
        started = time.monotonic()
        if self._worker is None:
            logits: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
            try:
                logits.set_result(self.model.forward(fb, self.pool))
            except Exception as exc:
                logits.set_exception(exc)
        else:
            self.pool.allocator.hold_frees()  # until `wait`: the forward may write any row
            logits = self._worker.submit(self.model.forward, fb, self.pool)
        return InFlight(batch, logits, masks, started)

    def wait(self, step: InFlight) -> tuple[torch.Tensor | None, Exception | None, Any]:
        """(logits [B, vocab] fp32 or None, the forward's exception or None, the masks) once
        the forward is done; the pages held back meanwhile are free from here on."""
        try:
            logits, error = step.logits.result(), None
        except Exception as exc:
            logits, error = None, exc
        finally:
            if self._worker is not None:
                self.pool.allocator.release_held()
        return logits, error, step.masks.result()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
