"""The cases of `duet bench-kernels`: DeepSeek-V2-Lite per-layer shapes, one generator per family.

A case binds its inputs into zero-argument callables: `run` goes through `native.ops` (weights
prepacked by ops.prepack_* before timing), `reference` through `native.reference` (the
correctness twin), and `others` holds the baselines a user would pick (bench/kernel_comparators:
torch's matmul for GEMM, SDPA for extend attention), each as named variants. `num_bytes` counts
weights and activations read and written once (for MoE only the experts the routing selected;
for mla_decode the KV rows read; quantized weights as stored, scales included: for int4 the
packed nibbles and group scales, `int4_stored_bytes`); `flops` counts multiply-adds as 2.
`compute` names the instruction family of the compute roof and `level` the memory the inputs
stream from (bench/roofline.py, bench/cache_defeat.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from bench.cache_defeat import copies_to_defeat, cycling, memory_level
from bench.kernel_comparators import Variants, int4_mm, int8_mm, sdpa, torch_linear_variants
from control.quant_schemes import INT4_GROUP_SIZE
from native import ops, reference, reference_int4

BF16 = torch.bfloat16
ELEM = 2  # bytes of a bf16 element


@dataclass(frozen=True)
class Dims:
    """Model dimensions and the token counts of the cases (defaults: DeepSeek-V2-Lite)."""

    hidden: int = 2048
    heads: int = 16
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    rope_dim: int = 64
    qk_nope_dim: int = 128
    v_head_dim: int = 128
    num_experts: int = 64
    top_k: int = 6
    moe_inter: int = 1408
    dense_inter: int = 10944
    vocab: int = 102400
    page_size: int = 16
    moe_decode_tokens: tuple[int, ...] = (1, 8)
    prefill_tokens: int = 2048
    gemm_tokens: int = 512
    mla_batches: tuple[int, ...] = (1, 8, 32)
    mla_contexts: tuple[int, ...] = (1024, 4096)
    extend_prefixes: tuple[int, ...] = (0, 2048)
    decode_tokens: tuple[int, ...] = (1, 32)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.rope_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def projections(self) -> dict[str, tuple[int, int]]:
        """Linear layers benchmarked as gemv/gemm: name -> (K in, N out)."""
        return {
            "dense_up": (self.hidden, self.dense_inter),
            "dense_down": (self.dense_inter, self.hidden),
            "q_a": (self.hidden, self.q_lora_rank),
            "q_b": (self.q_lora_rank, self.heads * self.qk_head_dim),
            "kv_a": (self.hidden, self.latent_dim),
            "o": (self.heads * self.v_head_dim, self.hidden),
        }

    @property
    def with_head(self) -> dict[str, tuple[int, int]]:
        """The projections and the LM head (bf16, or int8 with `quant_lm_head`; never fp8 or
        int4)."""
        return {**self.projections, "lm_head": (self.hidden, self.vocab)}


FULL = Dims()
QUICK = Dims(
    hidden=256,
    heads=2,
    q_lora_rank=96,
    kv_lora_rank=64,
    rope_dim=16,
    qk_nope_dim=32,
    v_head_dim=32,
    num_experts=8,
    top_k=2,
    moe_inter=96,
    dense_inter=320,
    vocab=512,
    prefill_tokens=48,
    gemm_tokens=16,
    mla_batches=(1, 3),
    mla_contexts=(40,),
    extend_prefixes=(0, 33),
    decode_tokens=(1,),
)


@dataclass
class Case:
    kernel: str
    shape: str
    num_bytes: int
    flops: int
    run: Callable[[], object]
    reference: Callable[[], object]
    others: dict[str, Variants] = field(default_factory=dict)  # baseline -> {variant: fn}
    compute: str = "bf16"  # roofline.COMPUTE_PROBES key: bf16 / bf16_tiles / int8 / fp32 / none
    level: str = "dram"  # roofline.MEMORY_LEVELS: where the inputs stream from


Wanted = Callable[[str], bool]


def _weight(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=BF16).uniform_(-0.05, 0.05)


def _act(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(BF16)


# ---- MoE -------------------------------------------------------------------------------------


def _moe_token_counts(d: Dims, prefix: str, wanted: Wanted) -> list[tuple[str, int]]:
    """(case name, tokens) of the decode and prefill rows of one fused-MoE family."""
    counts = [(f"{prefix}_decode", t) for t in d.moe_decode_tokens]
    counts.append((f"{prefix}_prefill", d.prefill_tokens))
    return [(name, t) for name, t in counts if wanted(name)]


def _moe_case(d: Dims, name: str, tokens: int, expert_bytes: int, run, reference, **extra) -> Case:
    """One fused-MoE row: `run` / `reference` (and each op of `others`) take (x, weights, ids).
    The cache defeat of MoE: successive calls route to different experts, through enough
    routings that one round reads more than the caches hold."""
    x = _act(tokens, d.hidden)
    routings = [_routing(d, tokens)]
    used_first = int(torch.unique(routings[0][1]).numel())
    routings += [
        _routing(d, tokens) for _ in range(copies_to_defeat(used_first * expert_bytes) - 1)
    ]
    used = sum(int(torch.unique(ids).numel()) for _, ids in routings) / len(routings)
    union = int(torch.unique(torch.cat([ids.flatten() for _, ids in routings])).numel())
    routing = cycling(routings)
    bind = lambda op: lambda: op(x, *routing())  # noqa: E731
    others = {
        family: {op_name: bind(op) for op_name, op in ops_.items()}
        for family, ops_ in extra.pop("others", {}).items()
    }
    return Case(
        kernel=name,
        shape=f"T={tokens} E={d.num_experts} K={d.top_k} D={d.hidden} I={d.moe_inter}",
        num_bytes=round(used * expert_bytes) + 2 * x.numel() * ELEM + tokens * d.top_k * 8,
        flops=2 * tokens * d.top_k * 3 * d.moe_inter * d.hidden,
        run=bind(run),
        reference=bind(reference),
        level=memory_level(union * expert_bytes),
        others=others,
        **extra,
    )


def moe_cases(d: Dims, wanted: Wanted) -> Iterator[Case]:
    token_counts = _moe_token_counts(d, "moe", wanted)
    if not token_counts:
        return
    w13, w2 = (
        _weight(d.num_experts, 2 * d.moe_inter, d.hidden),
        _weight(d.num_experts, d.hidden, d.moe_inter),
    )
    packed = ops.prepack_experts(w13, w2)
    ref_packed = reference.prepack_experts(w13, w2)
    expert_bytes = 3 * d.moe_inter * d.hidden * ELEM
    for name, tokens in token_counts:
        yield _moe_case(
            d,
            name,
            tokens,
            expert_bytes,
            run=lambda x, w, ids: ops.fused_moe(x, *packed, w, ids),
            reference=lambda x, w, ids: reference.fused_moe(x, *ref_packed, w, ids),
        )


def moe_int8_cases(d: Dims, wanted: Wanted) -> Iterator[Case]:
    """ops.fused_moe_int8 (W8A8: per-token and per-row activation quantization fused in) on the
    shapes and routings of moe_cases; compare with the bf16 moe_* rows of the same run."""
    token_counts = _moe_token_counts(d, "moe_int8", wanted)
    if not token_counts:
        return
    w13, w2 = (
        _weight(d.num_experts, 2 * d.moe_inter, d.hidden),
        _weight(d.num_experts, d.hidden, d.moe_inter),
    )
    ref_packed = reference.prepack_experts_int8(w13, w2)
    packed = ops.prepack_experts_int8(list(w13.unbind(0)), list(w2.unbind(0)))
    del w13, w2
    # int8 weights + per output channel an fp32 scale and an int32 comp.
    expert_bytes = 3 * d.moe_inter * d.hidden + 8 * (2 * d.moe_inter + d.hidden)
    for name, tokens in token_counts:
        yield _moe_case(
            d,
            name,
            tokens,
            expert_bytes,
            run=lambda x, w, ids: ops.fused_moe_int8(x, *packed, w, ids),
            reference=lambda x, w, ids: reference.fused_moe_int8(x, *ref_packed, w, ids),
            compute="int8",
        )


def moe_fp8_cases(d: Dims, wanted: Wanted) -> Iterator[Case]:
    """The routed experts with FP8 e4m3 weights (1 byte each, 128x128 block scales), held to the
    bf16 roof (converted to bf16 for vdpbf16ps) and compared with the bf16 fused MoE on the
    dequantized experts (the same values at 2 bytes each)."""
    token_counts = _moe_token_counts(d, "moe_fp8", wanted)
    if not token_counts:
        return
    packed = ops.prepack_experts_fp8_from(
        [_weight(2 * d.moe_inter, d.hidden) for _ in range(d.num_experts)],
        [_weight(d.hidden, d.moe_inter) for _ in range(d.num_experts)],
    )
    ref_packed = tuple(p.unpack() for p in packed)
    dequantized = [  # bf16 holds the dequantized values to within one rounding
        [w.to(BF16) for w in reference.dequantize_expert_fp8(*ref_packed, e)]
        for e in range(d.num_experts)
    ]
    bf16_packed = ops.prepack_experts([w[0] for w in dequantized], [w[1] for w in dequantized])
    del dequantized  # packed: the unpacked copies go
    scale_bytes = 4 * (2 * -(-d.moe_inter // 128) * -(-d.hidden // 128) * 2)
    expert_bytes = 3 * d.moe_inter * d.hidden + scale_bytes
    for name, tokens in token_counts:
        yield _moe_case(
            d,
            name,
            tokens,
            expert_bytes,
            run=lambda x, w, ids: ops.fused_moe_fp8(x, *packed, w, ids),
            reference=lambda x, w, ids: reference.fused_moe_fp8(x, *ref_packed, w, ids),
            others={
                "bf16": {"fused_moe": lambda x, w, ids: ops.fused_moe(x, *bf16_packed, w, ids)}
            },
        )


def moe_int4_cases(d: Dims, wanted: Wanted) -> Iterator[Case]:
    """ops.fused_moe_int4 (W4A8: int4 weights with an fp32 scale per INT4_GROUP_SIZE inputs,
    per-token and per-row activation quantization fused in, the "int4" scheme's experts) on the
    shapes and routings of moe_cases, an expert's bytes as stored (`int4_stored_bytes`); compared
    with ops.fused_moe_int8 on the same experts (the scheme int4 replaces, timed beside it)."""
    token_counts = _moe_token_counts(d, "moe_int4", wanted)
    if not token_counts:
        return
    w13, w2 = (
        _weight(d.num_experts, 2 * d.moe_inter, d.hidden),
        _weight(d.num_experts, d.hidden, d.moe_inter),
    )
    ref_packed = reference_int4.prepack_experts_int4(w13, w2, INT4_GROUP_SIZE)
    # (the prepacks consume the lists they are given: one pair each)
    packed = ops.prepack_experts_int4(list(w13.unbind(0)), list(w2.unbind(0)), INT4_GROUP_SIZE)
    int8_packed = ops.prepack_experts_int8(list(w13.unbind(0)), list(w2.unbind(0)))
    del w13, w2
    expert_bytes = int4_stored_bytes(*packed) // d.num_experts  # every expert the same size
    for name, tokens in token_counts:
        yield _moe_case(
            d,
            name,
            tokens,
            expert_bytes,
            run=lambda x, w, ids: ops.fused_moe_int4(x, *packed, w, ids),
            reference=lambda x, w, ids: reference_int4.fused_moe_int4(x, *ref_packed, w, ids),
            others={
                "int8": {
                    "fused_moe_int8": lambda x, w, ids: ops.fused_moe_int8(x, *int8_packed, w, ids)
                }
            },
            compute="int8",
        )


def _routing(d: Dims, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights, expert ids) of random router logits."""
    logits = torch.randn(tokens, d.num_experts)
    return reference.grouped_topk(logits, None, d.top_k, 1, 1, "softmax", "greedy", False, 1.0)


# ---- dense projections -----------------------------------------------------------------------


def linear_cases(d: Dims, wanted: Wanted) -> Iterator[Case]:
    for proj, (k, n) in d.with_head.items():
        rows = [(f"{fam}_{proj}", m) for fam, m in (("gemv", 1), ("gemm", d.gemm_tokens))]
        rows = [(name, m) for name, m in rows if wanted(name)]
        if not rows:
            continue
        copies = copies_to_defeat(n * k * ELEM)
        weights = [_weight(n, k) for _ in range(copies)]
        packed = cycling([ops.prepack_linear(w) for w in weights])
        ref_packed = cycling([reference.prepack_linear(w) for w in weights])
        for name, m in rows:
            x = _act(m, k)
            yield Case(
                kernel=name,
                shape=f"M={m} K={k} N={n}",
                num_bytes=(n * k + m * k + m * n) * ELEM,
                flops=2 * m * n * k,
                run=lambda x=x, w=packed: ops.linear(x, w()),
                reference=lambda x=x, w=ref_packed: reference.linear(x, w()),
                others={"torch": torch_linear_variants(x, weights)},
                level=memory_level(copies * n * k * ELEM),
            )


def fp8_linear_cases(d: Dims, wanted: Wanted) -> Iterator[Case]:
    """The dense projections with FP8 e4m3 weights (1 byte each, 128x128 block scales), held to
    the bf16 roof (the kernel converts to bf16 and uses vdpbf16ps) and compared with torch's
    bf16 matmuls on the dequantized weight."""
    for proj, (k, n) in d.projections.items():
        rows = [(f"{fam}_fp8_{proj}", m) for fam, m in (("gemv", 1), ("gemm", d.gemm_tokens))]
        rows = [(name, m) for name, m in rows if wanted(name)]
        if not rows:
            continue
        weight_bytes = n * k + 4 * -(-n // 128) * -(-k // 128)
        copies = copies_to_defeat(weight_bytes)
        packed_list = [ops.prepack_linear_fp8_from(_weight(n, k)) for _ in range(copies)]
        dequantized = [p.dequantize().to(BF16) for p in packed_list]
        packed = cycling(packed_list)
        ref_packed = cycling([reference.prepack_linear_fp8(*p.unpack()) for p in packed_list])
        for name, m in rows:
            x = _act(m, k)
            yield Case(
                kernel=name,
                shape=f"M={m} K={k} N={n}",
                num_bytes=weight_bytes + (m * k + m * n) * ELEM,
                flops=2 * m * n * k,
                run=lambda x=x, w=packed: ops.linear_fp8(x, w()),
                reference=lambda x=x, w=ref_packed: reference.linear_fp8(x, w()),
                others={"torch": torch_linear_variants(x, dequantized)},
                level=memory_level(copies * weight_bytes),
            )


# ---- INT8 W8A8 dense projections ------------------------------------------------------------


def int8_linear_cases(d: Dims, wanted: Wanted) -> Iterator[Case]:
    """ops.linear_int8 (per-token activation quantization fused in) on the projection shapes;
    the baseline is torch._int_mm on the already quantized operands (int32 out, no epilogue)."""
    for proj, (k, n) in d.with_head.items():
        rows = [(f"{fam}_int8_{proj}", m) for fam, m in (("gemv", 1), ("gemm", d.gemm_tokens))]
        rows = [(name, m) for name, m in rows if wanted(name)]
        if not rows:
            continue
        copies = copies_to_defeat(n * k)
        quantized, packed = [], []
        for _ in range(copies):
            w = _weight(n, k)
            quantized.append(reference.prepack_linear_int8(w))
            packed.append(ops.prepack_linear_int8(w))
        next_packed, next_ref = cycling(packed), cycling(quantized)
        for name, m in rows:
            x = _act(m, k)
            x_q = reference.quantize_per_token_int8(x)[0]
            int_mm = [int8_mm(x_q, q.qweight.t()) for q in quantized]
            baseline = {"_int_mm(x_q, w_q.t())": lambda c=cycling(int_mm): c()()}
            others = {} if None in int_mm else {"int_mm": baseline}
            yield Case(
                kernel=name,
                shape=f"M={m} K={k} N={n}",
                num_bytes=n * k + 8 * n + (m * k + m * n) * ELEM,  # + fp32 scale, int32 comp
                flops=2 * m * n * k,
                run=lambda x=x, w=next_packed: ops.linear_int8(x, w()),
                reference=lambda x=x, w=next_ref: reference.linear_int8(x, w()),
                others=others,
                compute="int8",
                level=memory_level(copies * n * k),
            )


# ---- INT4 W4A8 dense projections ------------------------------------------------------------


def int4_stored_bytes(*weights: object) -> int:
    """Bytes int4 weights are held in, as stored: the uint8 nibbles and fp32 scales of a
    PackedLinearInt4 / PackedExpertsInt4 (`packed.numel() + 4 * scales.numel()`, their padding
    to 16 rows and to whole groups included), or the int8 values and fp32 scales of the twin's
    Int4Weight where the kernel is off. The weight bytes of every int4 row."""
    total = 0
    for w in weights:
        is_twin = isinstance(w, reference_int4.Int4Weight)
        for t in (w.qweight, w.scale) if is_twin else (w.packed, w.scales):
            total += t.numel() * t.element_size()
    return total


def int4_linear_cases(d: Dims, wanted: Wanted) -> Iterator[Case]:
    """ops.linear_int4 (W4A8: int4 weights with an fp32 scale per INT4_GROUP_SIZE inputs of a
    row, per-token activation quantization fused in) on the projection shapes, the weight's
    bytes as stored (`int4_stored_bytes`). The "int4" scheme holds only the MLPs (dense_*) in
    int4 and keeps attention in int8; the attention shapes are here to compare the two kernels
    on every shape (the LM head is never int4: no row). Baselines:
    ops.linear_int8 on the same weight (the scheme int4 replaces, timed beside it) and, where
    this torch has it, torch's int4 weight-only GEMM on the same int4 values."""
    for proj, (k, n) in d.projections.items():
        rows = [(f"{fam}_int4_{proj}", m) for fam, m in (("gemv", 1), ("gemm", d.gemm_tokens))]
        rows = [(name, m) for name, m in rows if wanted(name)]
        if not rows:
            continue
        weights = [_weight(n, k)]
        packed = [ops.prepack_linear_int4(weights[0], INT4_GROUP_SIZE)]
        weight_bytes = int4_stored_bytes(packed[0])
        copies = copies_to_defeat(weight_bytes)
        weights += [_weight(n, k) for _ in range(copies - 1)]
        packed += [ops.prepack_linear_int4(w, INT4_GROUP_SIZE) for w in weights[1:]]
        quantized = [reference_int4.prepack_linear_int4(w, INT4_GROUP_SIZE) for w in weights]
        int8_packed = [ops.prepack_linear_int8(w) for w in weights]
        del weights
        next_packed, next_ref, next_int8 = cycling(packed), cycling(quantized), cycling(int8_packed)
        for name, m in rows:
            x = _act(m, k)
            others = {"int8": {"linear_int8": lambda x=x, w=next_int8: ops.linear_int8(x, w())}}
            torch_int4 = [int4_mm(x, q) for q in quantized]
            if None not in torch_int4:
                others["torch"] = {"_weight_int4pack_mm": lambda c=cycling(torch_int4): c()()}
            yield Case(
                kernel=name,
                shape=f"M={m} K={k} N={n}",
                num_bytes=weight_bytes + (m * k + m * n) * ELEM,
                flops=2 * m * n * k,
                run=lambda x=x, w=next_packed: ops.linear_int4(x, w()),
                reference=lambda x=x, w=next_ref: reference_int4.linear_int4(x, w()),
                others=others,
                compute="int8",
                level=memory_level(copies * weight_bytes),
            )


# ---- attention -------------------------------------------------------------------------------


def mla_decode_cases(d: Dims, wanted: Wanted) -> Iterator[Case]:
    if not wanted("mla_decode"):
        return
    sm_scale = 1.0 / math.sqrt(d.qk_head_dim)
    width = d.latent_dim
    for batch in d.mla_batches:
        for context in d.mla_contexts:
            pages_per_seq = -(-context // d.page_size)
            num_pages = batch * pages_per_seq
            kv_cache = _act(num_pages, d.page_size, width)
            # Pages of a sequence scattered over the pool, as after some churn.
            page_table = torch.randperm(num_pages).view(batch, pages_per_seq).to(torch.int32)
            seq_lens = torch.full((batch,), context, dtype=torch.int32)
            q = _act(batch, d.heads, width)
            copies = copies_to_defeat(kv_cache.numel() * ELEM)
            caches = cycling([kv_cache] + [kv_cache.clone() for _ in range(copies - 1)])
            args = (q, page_table, seq_lens, sm_scale, d.kv_lora_rank)
            yield Case(
                kernel="mla_decode",
                shape=f"B={batch} ctx={context} H={d.heads} W={width}",
                num_bytes=(batch * context * width + q.numel() + batch * d.heads * d.kv_lora_rank)
                * ELEM,
                flops=2 * batch * d.heads * context * (width + d.kv_lora_rank),
                run=lambda a=args, kv=caches: ops.mla_decode(a[0], kv(), *a[1:]),
                reference=lambda a=args, kv=caches: reference.mla_decode(a[0], kv(), *a[1:]),
                compute="bf16_tiles",
                level=memory_level(copies * kv_cache.numel() * ELEM),
            )


def extend_attention_cases(d: Dims, wanted: Wanted) -> Iterator[Case]:
    if not wanted("extend_attention"):
        return
    heads, dqk, dv, new_len = d.heads, d.qk_head_dim, d.v_head_dim, d.prefill_tokens
    sm_scale = 1.0 / math.sqrt(dqk)
    for prefix_len in d.extend_prefixes:
        q, k, v = _act(new_len, heads, dqk), _act(new_len, heads, dqk), _act(new_len, heads, dv)
        k_prefix, v_prefix = _act(prefix_len, heads, dqk), _act(prefix_len, heads, dv)
        tensors = (q, k, v, k_prefix, v_prefix)
        input_bytes = sum(t.numel() for t in tensors) * ELEM
        copies = copies_to_defeat(input_bytes)
        inputs = [tensors] + [tuple(t.clone() for t in tensors) for _ in range(copies - 1)]
        lens = (
            torch.tensor([new_len], dtype=torch.int32),
            torch.tensor([prefix_len], dtype=torch.int32),
        )
        args = cycling([(*t, *lens, sm_scale) for t in inputs])
        sdpa_calls = cycling([sdpa(*t, sm_scale) for t in inputs])
        pairs = new_len * prefix_len + new_len * (new_len + 1) // 2  # (query, key) pairs attended
        yield Case(
            kernel="extend_attention",
            shape=f"new={new_len} prefix={prefix_len} H={heads} qk={dqk} v={dv}",
            num_bytes=(
                2 * q.numel()
                + v.numel()
                + k_prefix.numel()
                + v_prefix.numel()
                + new_len * heads * dv
            )
            * ELEM,
            flops=2 * heads * pairs * (dqk + dv),
            run=lambda a=args: ops.extend_attention(*a()),
            reference=lambda a=args: reference.extend_attention(*a()),
            others={"sdpa": {"sdpa": lambda s=sdpa_calls: s()()}},
            level=memory_level(copies * input_bytes),
        )


# ---- small per-token ops ---------------------------------------------------------------------
# Memory-bound (compute "none"); their inputs are small enough to stay in cache between calls,
# so each is held to the roof of the cache its bytes fit in.


def small_op_cases(d: Dims, wanted: Wanted) -> Iterator[Case]:
    token_counts = (*d.decode_tokens, d.prefill_tokens)
    w = _weight(d.hidden) + 1
    for tokens in token_counts if wanted("rmsnorm") else ():
        x = _act(tokens, d.hidden)
        num_bytes = (2 * x.numel() + w.numel()) * ELEM
        yield Case(
            "rmsnorm",
            f"T={tokens} D={d.hidden}",
            num_bytes,
            4 * x.numel(),
            lambda x=x: ops.rms_norm(x, w, 1e-6),
            lambda x=x: reference.rms_norm(x, w, 1e-6),
            compute="none",
            level=memory_level(num_bytes),
        )
    for tokens in token_counts if wanted("rmsnorm_fused_add") else ():
        x, res = _act(tokens, d.hidden), _act(tokens, d.hidden)
        num_bytes = (4 * x.numel() + w.numel()) * ELEM
        yield Case(
            "rmsnorm_fused_add",
            f"T={tokens} D={d.hidden}",
            num_bytes,
            5 * x.numel(),
            lambda x=x, r=res: ops.fused_add_rms_norm(x, r, w, 1e-6),
            lambda x=x, r=res: reference.fused_add_rms_norm(x, r, w, 1e-6),
            compute="none",
            level=memory_level(num_bytes),
        )
    cos_sin = torch.randn(4096, d.rope_dim)
    for tokens in token_counts if wanted("rope") else ():
        # q_pe / k_pe are slices of q [T, H, nope + rope] and kv_a [T, L + rope], as in the model.
        q = _act(tokens, d.heads, d.qk_head_dim)[..., d.qk_nope_dim :]
        k = _act(tokens, d.latent_dim)[:, d.kv_lora_rank :]
        args = (q, k, torch.randint(0, 4096, (tokens,)), cos_sin)
        values = tokens * (d.heads + 1) * d.rope_dim
        num_bytes = 2 * values * ELEM + tokens * (d.rope_dim * 4 + 8)
        yield Case(
            "rope",
            f"T={tokens} H={d.heads} R={d.rope_dim}",
            num_bytes,
            3 * values,
            lambda a=args: ops.apply_rope(*a),
            lambda a=args: reference.apply_rope(*a),
            compute="none",
            level=memory_level(num_bytes),
        )
    for tokens in token_counts if wanted("topk") else ():
        logits = _act(tokens, d.num_experts)
        args = (logits, None, d.top_k, 1, 1, "softmax", "greedy", False, 1.0)
        num_bytes = logits.numel() * ELEM + tokens * d.top_k * 8
        yield Case(
            "topk",
            f"T={tokens} E={d.num_experts} K={d.top_k}",
            num_bytes,
            8 * logits.numel(),
            lambda a=args: ops.grouped_topk(*a),
            lambda a=args: reference.grouped_topk(*a),
            compute="none",
            level=memory_level(num_bytes),
        )


FAMILIES = (
    moe_cases,
    moe_int8_cases,
    moe_int4_cases,
    moe_fp8_cases,
    linear_cases,
    int8_linear_cases,
    int4_linear_cases,
    fp8_linear_cases,
    mla_decode_cases,
    extend_attention_cases,
    small_op_cases,
)


def all_cases(d: Dims, wanted: Wanted) -> Iterator[Case]:
    """Cases of every family whose kernel name `wanted` accepts, built one family at a time."""
    for family in FAMILIES:
        yield from family(d, wanted)
