"""Expert parallelism as a transform of `model.deepseek.DeepseekModel`: each rank holds a shard of
the routed experts, and every MoE layer's `routed_experts` hook becomes a dispatch/combine.

Per MoE layer (all ranks together, in the same order):
1. counts: each rank tells every other how many token rows it sends it (all_to_all_single of
   an int64 [R] vector);
2. dispatch: a token row goes once to each rank owning at least one of its top-k experts,
   together with its whole top-k ids and weights (all_to_all_single of rows packed as bytes:
   [x | ids | weights]); the fused MoE kernel on the receiver ignores ids outside its shard, so
   it returns the weighted sum over its local experts only;
3. combine: the partial outputs go back (all_to_all_single), are summed per token in fp32,
   and cast to the model dtype. Shared experts stay local (`MoE.__call__` adds them).

A rank with no tokens still calls every layer's exchange with T = 0 (`idle_step`), so the
collectives always match. With MTP (`mtp_passes` = the node's mtp_tokens), the MTP layer's MoE
is sharded the same way, and every step makes exactly `mtp_passes` MTP exchanges on every rank:
a rank's draft passes (at most that many: one, then one per chained draft), then idle ones for
the rest (`finish_mtp_step`), however many requests it drafts for. gloo implements
all_to_all_single with uneven splits (checked on torch 2.13 CPU), so no padding is needed.
`ranks = 1` never installs this: no communication. The shards: `model.sharding`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from model.deepseek import DeepseekModel
from model.layers import MoE
from model.sharding import check_shardable, expert_shard

__all__ = ["ExpertParallel", "check_shardable", "expert_shard"]


class ExpertParallel:
    """Installs dispatch/combine on every MoE layer of `model` (which must hold exactly this
    rank's shard, as loaded by `from_pretrained(expert_range=expert_shard(E, rank, world))`).

    `comm_seconds` accumulates the wall time of the three exchanges (for benchmarks)."""

    def __init__(self, model: DeepseekModel, rank: int, world: int, group=None):
        num_experts = model.cfg.n_routed_experts
        shard = expert_shard(num_experts, rank, world)
        if model.expert_range != shard:
            raise ValueError(
                f"rank {rank}/{world}: the model holds experts {model.expert_range}, "
                f"its shard is {shard}"
            )
        self.model = model
        self.rank, self.world, self.group = rank, world, group
        starts = [expert_shard(num_experts, r, world).start for r in range(world)]
        self._boundaries = torch.tensor(starts[1:], dtype=torch.int64)  # first id of ranks 1..
        self.moe_layers: list[MoE] = [
            layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)
        ]
        mtp_mlp = None if model.mtp is None else model.mtp.layer.mlp
        self.mtp_moe: MoE | None = mtp_mlp if isinstance(mtp_mlp, MoE) else None
        self.mtp_passes = 0  # MTP exchanges per step (the node's mtp_tokens when it speculates)
        self._mtp_exchanges = 0  # made in this step so far
        self.comm_seconds = 0.0
        for moe in (*self.moe_layers, *([self.mtp_moe] if self.mtp_moe is not None else [])):
            moe.routed_experts = self._hook(moe)
            moe.routed_adds_shared = True  # overlapped with the dispatch (dispatch_combine)

    def _hook(self, moe: MoE):
        return lambda x, weights, ids: self.dispatch_combine(moe, x, weights, ids)

    @torch.inference_mode()
    def idle_step(self) -> None:
        """Joins every MoE layer's exchange with no tokens of its own (serves the others), the
        step's MTP exchanges included."""
        for moe in self.moe_layers:
            self._idle_exchange(moe)
        self.finish_mtp_step()

    @torch.inference_mode()
    def finish_mtp_step(self) -> None:
        """After this rank's draft passes (if any): idle MTP exchanges up to `mtp_passes`."""
        if self.mtp_moe is not None:
            while self._mtp_exchanges < self.mtp_passes:
                self._idle_exchange(self.mtp_moe)
            if self._mtp_exchanges > self.mtp_passes:
                raise RuntimeError(
                    f"{self._mtp_exchanges} MTP exchanges in one step, the ranks agreed on "
                    f"{self.mtp_passes}"
                )
        self._mtp_exchanges = 0

    def _idle_exchange(self, moe: MoE) -> None:
        cfg = self.model.cfg
        k = cfg.num_experts_per_tok
        empty_x = torch.empty(0, cfg.hidden_size, dtype=self.model.dtype)
        empty_w = torch.empty(0, k, dtype=torch.float32)
        empty_ids = torch.empty(0, k, dtype=torch.int32)
        self.dispatch_combine(moe, empty_x, empty_w, empty_ids)

    def dispatch_combine(
        self, moe: MoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """x [T, D], weights [T, K] fp32, ids [T, K] int32 (global ids) -> [T, D] in x.dtype:
        the routed experts' weighted sum, computed by the ranks that own them, plus the shared
        experts' output, computed here while the dispatch exchange is in flight (the same sum,
        in the same order, as `MoE.__call__` without expert parallelism)."""
        if moe is self.mtp_moe:
            self._mtp_exchanges += 1
        num_tokens, hidden = x.shape
        top_k = ids.shape[1]
        # Which ranks each token needs; rows sorted rank-major so the splits are contiguous.
        owner = torch.bucketize(ids.long(), self._boundaries, right=True)  # [T, K]
        needs = torch.zeros(num_tokens, self.world, dtype=torch.bool)
        needs.scatter_(1, owner, True)
        dest, token = needs.t().nonzero(as_tuple=True)
        send_counts = needs.sum(0, dtype=torch.int64)  # [R]
        packed = _pack(
            x.index_select(0, token),
            ids.index_select(0, token).to(torch.int32),
            weights.index_select(0, token).to(torch.float32),
        )

        started = time.perf_counter()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        received = packed.new_empty(sum(recv_splits), packed.shape[1])
        exchange = dist.all_to_all_single(
            received, packed, recv_splits, send_splits, group=self.group, async_op=True
        )
        issued = time.perf_counter()
        shared = moe.shared(x) if moe.shared is not None and num_tokens else None
        computing = time.perf_counter() - issued
        exchange.wait()
        # Communication time: the exchange's wall time less the shared experts' compute.
        self.comm_seconds += max(0.0, time.perf_counter() - started - computing)

        rx, rids, rweights = _unpack(received, hidden, top_k, x.dtype)
        partial = moe.local_experts(rx, rweights, rids) if rx.shape[0] else rx  # [N_recv, D]

        started = time.perf_counter()
        back = partial.new_empty(len(token), hidden)
        dist.all_to_all_single(
            back, partial.contiguous(), send_splits, recv_splits, group=self.group
        )
        self.comm_seconds += time.perf_counter() - started
        out = torch.zeros(num_tokens, hidden, dtype=torch.float32)
        out.index_add_(0, token, back.float())
        out = out.to(x.dtype)
        return out if shared is None else out + shared


def _pack(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Rows [x | ids | weights] as bytes [N, D*es + 8K]: one exchange instead of three."""
    parts = [
        t.contiguous().view(torch.uint8).reshape(t.shape[0], t.shape[1] * t.element_size())
        for t in (x, ids, weights)
    ]
    return torch.cat(parts, dim=1)


def _unpack(rows: torch.Tensor, hidden: int, top_k: int, dtype: torch.dtype):
    """Inverse of `_pack`: (x [N, D] dtype, ids [N, K] int32, weights [N, K] fp32)."""
    x_bytes = hidden * torch.empty(0, dtype=dtype).element_size()
    x_part, ids_part, w_part = rows.split([x_bytes, 4 * top_k, 4 * top_k], dim=1)
    return (
        x_part.contiguous().view(dtype),
        ids_part.contiguous().view(torch.int32),
        w_part.contiguous().view(torch.float32),
    )
