"""Plain-torch versions of every op in `native.ops`.

They are the oracle of the kernel tests and the fallback on devices the C++ kernels do not cover.
They favour clarity over speed; accumulation is fp32, outputs take the input dtype.
Shapes use: T tokens, B sequences, H heads, D hidden, E experts, K top-k, L kv_lora_rank,
R rope dim, W = L + R (one cached latent row).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

# The counter-based sampling twins (race_sample, race_exponentials, random_uniform) live in
# native/reference_sampling.py with the definition of the random stream.
from native.reference_sampling import race_exponentials, race_sample, random_uniform  # noqa: F401

# ---- norms -----------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight.   x: [T, D], weight: [D] -> [T, D]."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual; returns (rms_norm(s), s).   x, residual: [T, D]."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


# ---- rotary embedding ------------------------------------------------------------------------


def apply_rope(
    q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved (DeepSeek) rotary embedding: pair (x[2i], x[2i+1]) rotates by angle pos * f_i.

    q_pe: [T, H, R], k_pe: [T, R], positions: [T] int64,
    cos_sin: [max_pos, R] fp32 holding cos(pos * f_i) in [:, :R/2] and sin in [:, R/2:].
    Returns new (q_pe, k_pe) of the input dtypes.
    """
    half = cos_sin.shape[1] // 2
    cs = cos_sin[positions.long()]
    cos, sin = cs[:, :half], cs[:, half:]  # [T, R/2]

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x0, x1 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        return out.flatten(-2).to(x.dtype)

    return rotate(q_pe, cos[:, None, :], sin[:, None, :]), rotate(k_pe, cos, sin)


# ---- dense layers ----------------------------------------------------------------------------


def prepack_linear(weight: torch.Tensor) -> torch.Tensor:
    """Prepares a [N, K] weight for `linear` (the kernels repack; the reference keeps it)."""
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x @ weight.T.   x: [T, K], weight: [N, K] (as returned by prepack_linear) -> [T, N]."""
    return F.linear(x, weight.to(x.dtype))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> silu(gate) * up: [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def prepack_bmm(b: torch.Tensor) -> torch.Tensor:
    """Prepares a constant right operand b [N, K, P] of `bmm` (kernels repack; the reference
    keeps it, contiguous: a slice of a larger weight stays no view of all of it, and a model
    mapped from a pack, which stores it contiguous, computes exactly what it computes)."""
    return b.contiguous()


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched matmul.  a: [N, M, K], b: [N, K, P] -> [N, M, P] (fp32 accumulation)."""
    return torch.bmm(a.float(), b.float()).to(a.dtype)


# ---- FP8 e4m3 weight-only linear -------------------------------------------------------------
# DeepSeek's block FP8: w [N, K] = w_fp8 * scale_inv[n // 128, k // 128] (weight_scale_inv as in the
# checkpoints). Same math as model/fp8_blocks.py's quantize_/dequantize_fp8_blockwise (the tests pin
# them equal); native knows no model, so it does not import it.

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def dequantize_fp8_blocks(
    w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
) -> torch.Tensor:
    """float32 [N, K] = w_fp8 [N, K] (float8_e4m3fn) * scale_inv [ceil(N/b0), ceil(K/b1)] for
    blocks `block` = (b0, b1)."""
    n, k = w_fp8.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return w_fp8.float() * scale[:n, :k]


def quantize_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantizes w [N, K] to (w_fp8 [N, K] float8_e4m3fn, scale_inv [N/128, K/128] fp32).

    scale_inv = amax(|block|) / 448 (1 for an all-zero block), w_fp8 = w / scale_inv rounded to
    nearest e4m3 (clamped to +-448)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(
            f"quantize_fp8_blocks: needs a 2-D float tensor, got {w.dtype} {list(w.shape)}"
        )
    n, k = w.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.zeros(nb * FP8_BLOCK, kb * FP8_BLOCK, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w
    blocks = padded.view(nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    q = q.view(nb * FP8_BLOCK, kb * FP8_BLOCK)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale_inv.contiguous()


def prepack_linear_fp8(
    weight_fp8: torch.Tensor, scale_inv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prepares an FP8 weight [N, K] and its block scales for `linear_fp8` (kept as they are)."""
    return weight_fp8, scale_inv.float()


def prepack_linear_fp8_from(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`prepack_linear_fp8` of a bf16 / fp32 weight block-quantized by `quantize_fp8_blocks`."""
    return prepack_linear_fp8(*quantize_fp8_blocks(weight))


def linear_fp8(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """y = x @ dequantize(weight).T.   x: [..., K], weight: (w_fp8 [N, K], scale_inv) -> [..., N].

    The e4m3 values are exact in bf16; the kernel sums x times them in fp32 per 128-wide k block
    and scales each block's sum, this twin scales each weight in fp32 first. The two differ by
    fp32 rounding and summation order only; the output is rounded to x.dtype once."""
    w = dequantize_fp8_blocks(*weight)
    return F.linear(x.float(), w.to(x.device)).to(x.dtype)


# ---- INT8 W8A8 linear ------------------------------------------------------------------------
# Symmetric int8 with one fp32 scale per row (weights: per output channel; activations: per
# token): scale = absmax / 127, q = round_half_even(v * (127 / absmax)) clamped to [-127, 127];
# rows with absmax < INT8_MIN_ABSMAX quantize to zeros with scale 0. The kernel
# (native/csrc/gemm_int8.h) computes exactly these integers and the same epilogue.

INT8_MIN_ABSMAX = 1e-30  # kInt8MinAbsmax of gemm_int8.h


class Int8Weight(NamedTuple):
    """A weight quantized for `linear_int8`: qweight int8 [N, K], scale fp32 [N]."""

    qweight: torch.Tensor
    scale: torch.Tensor


def _quantize_rows_int8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of a [R, C] tensor -> (q int8 [R, C], scale fp32 [R])."""
    vf = v.float()
    absmax = vf.abs().amax(-1) if vf.shape[-1] else vf.new_zeros(vf.shape[:-1])
    ok = absmax >= INT8_MIN_ABSMAX
    # Two correctly rounded fp32 divisions, as the kernel does them (`127.0 / t` would be computed
    # as t.reciprocal() * 127, rounded twice).
    c127 = torch.full_like(absmax, 127.0)
    inv = torch.where(ok, c127 / absmax, 0.0)
    scale = torch.where(ok, absmax / c127, 0.0)
    q = torch.round(vf * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_pack_int8_rows(
    weight: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    comp: torch.Tensor,
    row_offset: int = 0,
) -> None:
    """Quantizes float rows weight [n, K] per row (`quantize_weight_int8`) into rows
    [row_offset, row_offset + n) of the packed int8 layout of `linear_int8`'s kernel: packed
    int8 [ceil(N/16), ceil(K/4), 16, 4] (row r, column c at [r // 16, c // 4, r % 16, c % 4]),
    scale fp32 [16 * ceil(N/16)] and comp int32 (128 * the row's sum of q), in place."""
    q, row_scale = _quantize_rows_int8(weight)
    n, k = q.shape
    blocks, groups = packed.shape[:2]
    rows = packed.transpose(1, 2).reshape(blocks * 16, groups * 4).clone()
    rows[row_offset : row_offset + n, :k] = q
    packed.copy_(rows.view(blocks, 16, groups, 4).transpose(1, 2))
    scale[row_offset : row_offset + n] = row_scale
    comp[row_offset : row_offset + n] = 128 * q.sum(1, dtype=torch.int32)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], scale fp32 [M]) with x ~= q * scale[:, None]."""
    return _quantize_rows_int8(x)


def quantize_weight_int8(weight: torch.Tensor) -> Int8Weight:
    """weight [N, K] -> per-output-channel int8 with weight ~= qweight * scale[:, None]."""
    return Int8Weight(*_quantize_rows_int8(weight))


def prepack_linear_int8(weight: torch.Tensor) -> Int8Weight:
    """Quantizes a float weight [N, K] for `linear_int8` (the kernels also repack it)."""
    return quantize_weight_int8(weight)


def linear_int8(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """W8A8 y ~= x @ W.T: x [M, K] quantized per token, int32 sums of the int8 products,
    y = float(sum) * x_scale[m] * w_scale[n] (in that order), returned in x.dtype. [M, N]."""
    q, x_scale = quantize_per_token_int8(x)
    sums = q.int() @ weight.qweight.int().T
    return (sums.float() * x_scale[:, None] * weight.scale[None, :]).to(x.dtype)


# ---- MoE -------------------------------------------------------------------------------------


def router_logits(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The MoE gate in fp32: x [T, D] @ gate [E, D]^T (both widened to fp32) -> [T, E] fp32."""
    return F.linear(x.float(), gate.float())


def grouped_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring_func: str,
    topk_method: str,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing.   router_logits: [T, E] -> (weights [T, K] fp32, ids [T, K] int32).

    scores = softmax or sigmoid of the logits; choice scores add the correction bias (noaux_tc).
    Groups are ranked by the sum of their top-2 choice scores (noaux_tc) or their max
    (group_limited_greedy); only experts of the best `topk_group` groups compete ("greedy" has
    no groups). Weights are the unbiased scores of the chosen experts, renormalized to sum 1 when
    `norm_topk_prob`, then multiplied by `routed_scaling_factor`.
    """
    logits = router_logits.float()
    scores = logits.softmax(-1) if scoring_func == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    num_tokens, num_experts = choice.shape
    if topk_method != "greedy" and n_group > 1:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        if topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def prepack_experts(
    w13: torch.Tensor | list[torch.Tensor], w2: torch.Tensor | list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prepares routed-expert weights for `fused_moe` (kernels repack; the reference keeps them).

    w13: [E, 2I, D] ([gate | up] rows per expert), w2: [E, D, I]; or each a list of the E
    experts' tensors, stacked here."""
    stack = lambda w: torch.stack(w) if isinstance(w, list) else w  # noqa: E731
    return stack(w13), stack(w2)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """Routed experts: out[t] = sum_k w[t,k] * expert_{id[t,k]}(x[t]).

    x: [T, D]; w13: [E_local, 2I, D] ([gate | up] rows); w2: [E_local, D, I] (both as returned
    by prepack_experts);
    topk_weights: [T, K] fp32; topk_ids: [T, K] int32 global expert ids. Only experts
    expert_offset .. expert_offset + E_local - 1 are held here; other ids contribute nothing
    (expert parallelism sums the partial outputs across ranks). Returns [T, D] in x.dtype.
    """
    num_local = w13.shape[0]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    local_ids = topk_ids.long() - expert_offset
    counts = torch.bincount(local_ids.clamp(0, num_local).flatten(), minlength=num_local + 1)
    for e in range(num_local):
        if counts[e] == 0:
            continue
        token_idx, slot = torch.nonzero(local_ids == e, as_tuple=True)
        h = silu_and_mul(linear(x[token_idx], w13[e]))
        y = linear(h, w2[e]).float()
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None].float())
    return out.to(x.dtype)


# ---- INT8 W8A8 MoE ---------------------------------------------------------------------------
# fused_moe with linear_int8's scheme in both projections (native/csrc/moe_int8.cpp repeats each
# step): x quantized per token once, gate/up int32 sums dequantized to fp32, h = silu(g) * u in
# fp32, h quantized again per (token, expert) row for the down projection.


def prepack_experts_int8(
    w13: torch.Tensor | list[torch.Tensor], w2: torch.Tensor | list[torch.Tensor]
) -> tuple[Int8Weight, Int8Weight]:
    """Quantizes routed experts per output channel: w13 [E, 2I, D] -> Int8Weight(q [E, 2I, D],
    scale [E, 2I]), w2 [E, D, I] -> Int8Weight(q [E, D, I], scale [E, D]) (lists are stacked)."""
    stacked = prepack_experts(w13, w2)
    out = []
    for w in stacked:
        q, scale = _quantize_rows_int8(w.reshape(-1, w.shape[-1]))
        out.append(Int8Weight(q.view(w.shape), scale.view(w.shape[:-1])))
    return out[0], out[1]


def fused_moe_int8(
    x: torch.Tensor,
    w13: Int8Weight,
    w2: Int8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """Routed experts in W8A8 int8, the contract of `fused_moe` with weights from
    `prepack_experts_int8`. Returns [T, D] in x.dtype."""
    num_local = w13.qweight.shape[0]
    inter = w13.qweight.shape[1] // 2
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    qx, x_scale = quantize_per_token_int8(x)
    local_ids = topk_ids.long() - expert_offset
    for e in range(num_local):
        token_idx, slot = torch.nonzero(local_ids == e, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        sums = qx[token_idx].int() @ w13.qweight[e].int().T
        gate_up = sums.float() * x_scale[token_idx, None] * w13.scale[e][None, :]
        g, u = gate_up[:, :inter], gate_up[:, inter:]
        h = g / (1.0 + torch.exp(-g)) * u
        qh, h_scale = _quantize_rows_int8(h)
        y = (qh.int() @ w2.qweight[e].int().T).float() * h_scale[:, None] * w2.scale[e][None, :]
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None].float())
    return out.to(x.dtype)


# ---- FP8 MoE -----------------------------------------------------------------------------------
# FP8 experts (DeepSeek block FP8): w13 = (w_fp8 [E, 2I, D], scale_inv [E, 2 ceil(I/128), ceil(D/128)])
# with gate's scale rows first, then up's (gate_proj and up_proj weight_scale_inv concatenated:
# each of the two [I, D] halves has its own 128 x 128 blocks); w2 = (w_fp8 [E, D, I],
# scale_inv [E, ceil(D/128), ceil(I/128)]).


def dequantize_expert_fp8(w13, w2, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (w13 [2I, D], w2 [D, I]) of expert e: the exact values the fp8 MoE multiplies by."""
    (q13, s13), (q2, s2) = w13, w2
    inter, rows = q13.shape[1] // 2, s13.shape[1] // 2
    gate = dequantize_fp8_blocks(q13[e, :inter], s13[e, :rows])
    up = dequantize_fp8_blocks(q13[e, inter:], s13[e, rows:])
    return torch.cat([gate, up]), dequantize_fp8_blocks(q2[e], s2[e])


def prepack_experts_fp8(w13, w2, scale13, scale2):
    """Prepares FP8 experts for `fused_moe_fp8`: ((w13_fp8, scale13), (w2_fp8, scale2)) stacked,
    each argument a tensor or a list of the E experts' tensors (layout above)."""
    stack = lambda w: torch.stack(w) if isinstance(w, list) else w  # noqa: E731
    return (stack(w13), stack(scale13).float()), (stack(w2), stack(scale2).float())


def quantize_expert_fp8(w: torch.Tensor, halves: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantizes one expert's w13 [2I, D] (halves=2: gate and up apart) or w2 [D, I]
    (halves=1) -> (w_fp8, scale_inv) in the layout above."""
    parts = [quantize_fp8_blocks(half) for half in w.chunk(halves)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def quantize_experts_fp8(w13, w2):
    """Block-quantizes bf16 / fp32 experts (tensors or lists) -> the arguments of
    `prepack_experts_fp8` (w13_fp8, w2_fp8, scale13, scale2), as lists."""
    q13, s13 = zip(*(quantize_expert_fp8(w, 2) for w in w13), strict=True)
    q2, s2 = zip(*(quantize_expert_fp8(w, 1) for w in w2), strict=True)
    return list(q13), list(q2), list(s13), list(s2)


def prepack_experts_fp8_from(w13, w2):
    """`prepack_experts_fp8` of bf16 / fp32 experts block-quantized by `quantize_experts_fp8`."""
    return prepack_experts_fp8(*quantize_experts_fp8(w13, w2))


def fused_moe_fp8(
    x: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """`fused_moe` with FP8 experts (as returned by prepack_experts_fp8). x: [T, D] -> [T, D].

    The kernel's math: the exact dequantized weights in fp32, gate / up / down sums in fp32,
    silu(gate) * up rounded to x.dtype (the bf16 intermediate of the fused MoE kernels); the
    kernel differs only by fp32 summation order (per 128-wide k block, then scaled)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    local_ids = topk_ids.long() - expert_offset
    for e in range(w13[0].shape[0]):
        token_idx, slot = torch.nonzero(local_ids == e, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        d13, d2 = dequantize_expert_fp8(w13, w2, e)
        h = silu_and_mul(F.linear(x[token_idx].float(), d13.to(x.device))).to(x.dtype).float()
        y = F.linear(h, d2.to(x.device))
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None].float())
    return out.to(x.dtype)


# ---- attention -------------------------------------------------------------------------------


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    new_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Prefill attention over a batch of sequences, each = cached prefix + new tokens.

    q, k: [T, H, Dqk] and v: [T, H, Dv] for the new tokens of all sequences, packed in order;
    k_prefix: [P, H, Dqk], v_prefix: [P, H, Dv] the prefix rows, packed in the same order;
    new_lens, prefix_lens: [B] int. A query attends every prefix row of its sequence and the
    new keys up to its own position (causal). Returns [T, H, Dv] in q.dtype.
    """
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    new_start = prefix_start = 0
    for new_len, prefix_len in zip(new_lens.tolist(), prefix_lens.tolist(), strict=True):
        if new_len > 0:
            qs = q[new_start : new_start + new_len].float().transpose(0, 1)  # [H, n, Dqk]
            ks = torch.cat(
                (
                    k_prefix[prefix_start : prefix_start + prefix_len],
                    k[new_start : new_start + new_len],
                )
            )
            vs = torch.cat(
                (
                    v_prefix[prefix_start : prefix_start + prefix_len],
                    v[new_start : new_start + new_len],
                )
            )
            scores = qs @ ks.float().permute(1, 2, 0) * sm_scale  # [H, n, prefix + n]
            causal = torch.ones(new_len, new_len, dtype=torch.bool, device=q.device).tril()
            mask = torch.cat(
                (torch.ones(new_len, prefix_len, dtype=torch.bool, device=q.device), causal), dim=1
            )
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = scores.softmax(-1)
            o = probs @ vs.float().transpose(0, 1)  # [H, n, Dv]
            out[new_start : new_start + new_len] = o.transpose(0, 1).to(q.dtype)
        new_start += new_len
        prefix_start += prefix_len
    return out


def page_slots(page_table_row: torch.Tensor, start: int, end: int, page_size: int) -> torch.Tensor:
    """Flat cache slots (page * page_size + offset) of token positions [start, end)."""
    pos = torch.arange(start, end, device=page_table_row.device)
    return page_table_row[pos // page_size].long() * page_size + pos % page_size


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    new_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode over the paged latent cache of one layer.

    q: [B, H, W] (q_nope absorbed into the latent space | roped q_pe);
    kv_cache: [num_pages, page_size, W]; page_table: [B, max_pages] int32;
    seq_lens: [B] int32, the context length including the token being decoded;
    new_rows: [B, W] or None. When given, row b is first stored at position seq_lens[b] - 1
    (this mutates kv_cache). Keys are the full rows, values their first kv_lora_rank columns.
    Returns [B, H, kv_lora_rank] in q.dtype (zeros for a sequence of length 0).
    """
    page_size = kv_cache.shape[1]
    flat = kv_cache.view(-1, kv_cache.shape[2])
    out = torch.zeros(q.shape[0], q.shape[1], kv_lora_rank, dtype=q.dtype, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        slots = page_slots(page_table[b], 0, seq_len, page_size)
        if new_rows is not None:
            flat[slots[-1]] = new_rows[b].to(flat.dtype)
        rows = flat[slots].float()  # [S, W]
        scores = q[b].float() @ rows.T * sm_scale  # [H, S]
        out[b] = (scores.softmax(-1) @ rows[:, :kv_lora_rank]).to(q.dtype)
    return out


def store_kv_rows(kv_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """kv_cache.view(-1, W)[slots] = rows.   kv_cache: [num_pages, page_size, W] (one layer)."""
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slots.long(), rows.to(kv_cache.dtype))


def gather_kv_rows(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows at the given flat slots: [S, W]."""
    return kv_cache.view(-1, kv_cache.shape[-1]).index_select(0, slots.long())


# ---- checksum ------------------------------------------------------------------------------
CHECKSUM_CHUNK_ROWS = 16384  # rows of 8 uint64 lanes per chunk (1 MiB)
_CHECKSUM_MIX = 0x9E3779B97F4A7C15


def _as_int64(value: int) -> int:
    """A uint64 as the int64 of the same bits (torch's integer arithmetic wraps mod 2^64)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def checksum(data: torch.Tensor) -> int:
    """A 64-bit checksum of a tensor's bytes (any dtype, contiguous), as an unsigned int.

    The bytes, zero-padded to a multiple of 64, are rows of 8 little-endian uint64 lanes, cut
    into chunks of CHECKSUM_CHUNK_ROWS rows. Per chunk c and lane j, with n the chunk's rows,
    a = sum_k w[k][j] and b = sum_k (n - k) w[k][j]; the checksum is
    sum_{c,j} (a * 0x9E3779B97F4A7C15 + b) * (2 (8c + j) + 1), all mod 2^64."""
    raw = data.detach().contiguous().view(-1).view(torch.uint8)
    raw = F.pad(raw, (0, -raw.numel() % 64))
    words = raw.view(torch.int64).view(-1, 8)
    total = 0
    for c, chunk in enumerate(words.split(CHECKSUM_CHUNK_ROWS)):
        n = chunk.shape[0]
        a = chunk.sum(0)
        b = (chunk * torch.arange(n, 0, -1, dtype=torch.int64)[:, None]).sum(0)
        lanes = torch.arange(8, dtype=torch.int64) + 8 * c
        mixed = (a * _as_int64(_CHECKSUM_MIX) + b) * (2 * lanes + 1)
        total += int(mixed.sum())
    return total % (1 << 64)
