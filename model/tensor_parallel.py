"""Tensor parallelism (the prefill node's `ranks`, `parallel = "tp"`) as a transform of
`model.deepseek.DeepseekModel`: a model loaded with `tensor_parallel = (rank, world)` holds its
rank's heads, MLP columns and routed experts (`model.sharding.ShardedWeights`), so its
attention output (after o_proj) and its MLP / MoE output are partial sums over the ranks; this
all-reduces each, which makes every rank's residual stream, and so its KV rows and logits, the
same as one rank's with the whole model (up to the order of the sum).

Two all-reduces a layer, each of a [T, D] tensor, summed in fp32 whatever the model dtype (a
bf16 partial sum per rank, rounded once more when the sum is cast back): over gloo
(`gloo_all_reduce`; across hosts) or, for ranks on one host, through one shared-memory segment
(`shm_all_reduce`, `native/csrc/shm_allreduce.cpp`: a copy in, a barrier, a sum out). Both
also all-gather and all-to-all, for the sequence-split scheme (`model.sequence_parallel`).
`traffic_per_layer` counts what each scheme sends."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable

import torch
import torch.distributed as dist

from model.deepseek import DeepseekModel
from model.sharding import SHM_CAPACITY

AllReduce = Callable[[torch.Tensor], torch.Tensor]


class _Reduced:
    """`inner(x)`, all-reduced."""

    def __init__(self, inner: Callable[[torch.Tensor], torch.Tensor], all_reduce: AllReduce):
        self.inner, self.all_reduce = inner, all_reduce

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.inner(x))


def gloo_all_reduce(group=None) -> GlooComm:
    """A sum over the group's ranks with `torch.distributed` (gloo here, NCCL on a GPU), in
    fp32: every rank gets the same bytes back."""
    return GlooComm(group)


class GlooComm:
    """The ranks' collectives over `torch.distributed`: called, the fp32 all-reduce;
    `all_gather` and `all_to_all` for the sequence-split scheme (`model.sequence_parallel`)."""

    def __init__(self, group=None):
        self.group = group

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        total = partial.float()  # (in place when fp32: the partial is not used again)
        dist.all_reduce(total, group=self.group)
        return total.to(partial.dtype)

    def all_gather(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's `part` (the same shape on each), stacked in rank order: [R, *shape]."""
        part = part.contiguous()
        world = dist.get_world_size(self.group)
        out = torch.empty((world, *part.shape), dtype=part.dtype)
        dist.all_gather(list(out.unbind(0)), part, group=self.group)
        return out

    def all_to_all(self, pieces: torch.Tensor) -> torch.Tensor:
        """pieces [R, ...]: piece r for rank r -> [R, ...]: the piece each rank has for this
        one, in rank order."""
        out = torch.empty_like(pieces)
        dist.all_to_all_single(out, pieces.contiguous(), group=self.group)
        return out

    def abort(self) -> None:
        """Nothing to do: a dead peer's closed sockets fail gloo's waits by themselves."""


def shm_all_reduce(
    rank: int, world: int, group=None, timeout_s: float = 60.0, capacity: int = SHM_CAPACITY
) -> ShmComm:
    """The group's sum through one shared-memory segment (its ranks must share a host): rank 0
    creates it under /dev/shm with a random name, which it sends the others over the group
    (as bytes: no pickle); once every rank has mapped it, rank 0 unlinks it, so it is gone
    with the last rank whatever way the ranks end. A peer missing for `timeout_s` is an
    error, and so is any wait after `abort()`."""
    from native import _C

    token = torch.zeros(16, dtype=torch.uint8)
    if rank == 0:
        token[:] = torch.frombuffer(bytearray(secrets.token_hex(8).encode()), dtype=torch.uint8)
    name = lambda: f"/dev/shm/duet-tp-{bytes(token.tolist()).decode()}"  # noqa: E731
    if rank == 0:
        path = name()
        shm = _C.ShmAllReduce(path, rank, world, capacity, True, timeout_s)
        try:
            dist.broadcast(token, 0, group=group)
            shm.barrier()  # every rank holds the mapping now
        finally:  # gone with the last rank however the ranks end (at once if the setup failed)
            os.unlink(path)
    else:
        dist.broadcast(token, 0, group=group)
        shm = _C.ShmAllReduce(name(), rank, world, capacity, False, timeout_s)
        shm.barrier()
    return ShmComm(shm, world)


class ShmComm:
    """The collectives `shm_all_reduce` makes: called, the fp32 all-reduce; `all_gather` and
    `all_to_all` as GlooComm's; `abort()` fails every rank's wait at once (rank 0's watchdog calls it when a
    rank dies: the others would wait for it until the timeout)."""

    def __init__(self, shm, world: int):
        self.shm, self.world = shm, world

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        total = partial.float().contiguous()  # (in place when fp32: not used again)
        self.shm.all_reduce(total.data_ptr(), total.numel())
        return total.to(partial.dtype)

    def all_gather(self, part: torch.Tensor) -> torch.Tensor:
        part = part.contiguous()
        out = torch.empty((self.world, *part.shape), dtype=part.dtype)
        nbytes = part.numel() * part.element_size()
        self.shm.all_gather(part.data_ptr(), nbytes, out.data_ptr())
        return out

    def all_to_all(self, pieces: torch.Tensor) -> torch.Tensor:
        pieces = pieces.contiguous()
        out = torch.empty_like(pieces)
        piece_bytes = pieces[0].numel() * pieces.element_size()
        self.shm.all_to_all(pieces.data_ptr(), piece_bytes, out.data_ptr())
        return out

    def abort(self) -> None:
        self.shm.abort()


def install_tensor_parallel(model: DeepseekModel, all_reduce: AllReduce) -> None:
    """Makes `model` (a tensor-parallel shard) all-reduce after every o_proj and every MLP,
    the MTP layer's included."""
    if model.tensor_parallel is None:
        raise ValueError("the model was not loaded as a tensor-parallel shard")
    layers = [*model.layers, *([model.mtp.layer] if model.mtp is not None else [])]
    for layer in layers:
        layer.attn.o_proj = _Reduced(layer.attn.o_proj, all_reduce)
        layer.mlp = _Reduced(layer.mlp, all_reduce)


def traffic_per_layer(cfg, tokens: int, world: int, act_bytes: int = 2) -> dict[str, float]:
    """Bytes one rank sends per layer, by scheme, for `tokens` tokens over `world` ranks (ring
    collectives: an all-reduce of N elements sends 2 (R-1)/R N, an all-gather, reduce-scatter or
    all-to-all (R-1)/R N). The dry-run that explains the choice by numbers, as the seeds' 2P1D
    prefill does (its schemes one to three):
    - "tp" (what `install_tensor_parallel` does): heads split, the latent down-projections
      whole on every rank; all-reduce (fp32) of [T, D] after o_proj and after the MLP;
    - "tp_sp_reduce_scatter": the down-projections sequence-split, their [T, q | kv | rope]
      output all-gathered; heads split; o_proj's partial sums reduce-scattered (fp32) to the
      sequence split, which the MLP keeps;
    - "tp_sp" (the seeds' choice, `model.sequence_parallel`): as above, but the attention
      output goes head-split -> sequence-split by one all-to-all, and o_proj runs
      sequence-split.
    The sequence-split MLP needs every rank to hold the whole MLP (or an expert-parallel
    exchange, not counted): the price of the smaller traffic."""
    share = (world - 1) / world
    d = cfg.hidden_size
    latent = (cfg.q_lora_rank or d) + cfg.kv_lora_rank + cfg.qk_rope_head_dim
    attn_out = cfg.num_attention_heads * cfg.v_head_dim
    return {
        "tp": 2 * (2 * share * tokens * d * 4),
        "tp_sp_reduce_scatter": share * tokens * latent * act_bytes + share * tokens * d * 4,
        "tp_sp": share * tokens * latent * act_bytes
        + share * tokens * attn_out / world * act_bytes,
    }
