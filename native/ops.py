"""Ops the model calls: torch tensors in and out, dispatched to the C++ kernels in `native._C`
when the tensors are on the CPU in a dtype the kernel covers, else to the twin of the same name
in `native.reference` (the oracle in tests and the fallback on other devices).

Every public function here has the signature and contract of its reference twin; see the
docstrings in `native/reference.py`. Set DUET_NATIVE=0 to force the reference path.
"""

from __future__ import annotations

from native import (
    _attention_ops,
    _fp8_ops,
    _gemm_ops,
    _int4_ops,
    _mla_ops,
    _moe_fp8_ops,
    _moe_int4_ops,
    _moe_int8_ops,
    _quant_ops,
    _sampling_ops,
    _small_ops,
    reference,
    reference_int4,
)
from native.switch import native_available, set_native_enabled, set_num_threads  # noqa: F401

# Ops not yet backed by a kernel are the reference twins themselves.
rms_norm = _small_ops.rms_norm
fused_add_rms_norm = _small_ops.fused_add_rms_norm
apply_rope = _small_ops.apply_rope
prepack_linear = _gemm_ops.prepack_linear
linear = _gemm_ops.linear
prepack_linear_fp8 = _fp8_ops.prepack_linear_fp8
prepack_linear_fp8_from = _fp8_ops.prepack_linear_fp8_from
linear_fp8 = _fp8_ops.linear_fp8
prepack_linear_int8 = _quant_ops.prepack_linear_int8
linear_int8 = _quant_ops.linear_int8
prepack_linear_int4 = _int4_ops.prepack_linear_int4  # twins in native/reference_int4.py
linear_int4 = _int4_ops.linear_int4
PackedLinearInt4 = _int4_ops.PackedLinearInt4  # what prepack_linear_int4 returns (kernel on)
PackedLinear = _gemm_ops.PackedLinear  # what prepack_linear returns (kernel on)
PackedLinearInt8 = _quant_ops.PackedLinearInt8  # what prepack_linear_int8 returns (kernel on)
Int4Weight = reference_int4.Int4Weight  # (kernel off)
silu_and_mul = _small_ops.silu_and_mul
bmm = _gemm_ops.bmm
prepack_bmm = _gemm_ops.prepack_bmm
router_logits = _small_ops.router_logits
grouped_topk = _small_ops.grouped_topk
prepack_experts = _gemm_ops.prepack_experts
fused_moe = _gemm_ops.fused_moe
prepack_experts_int8 = _moe_int8_ops.prepack_experts_int8
fused_moe_int8 = _moe_int8_ops.fused_moe_int8
prepack_experts_int4 = _moe_int4_ops.prepack_experts_int4
fused_moe_int4 = _moe_int4_ops.fused_moe_int4
prepack_experts_fp8 = _moe_fp8_ops.prepack_experts_fp8
prepack_experts_fp8_from = _moe_fp8_ops.prepack_experts_fp8_from
fused_moe_fp8 = _moe_fp8_ops.fused_moe_fp8
extend_attention = _attention_ops.extend_attention
mla_decode = _attention_ops.mla_decode
mla_decode_absorbed = _mla_ops.mla_decode_absorbed  # twin in native/reference_mla.py
store_kv_rows = reference.store_kv_rows
gather_kv_rows = reference.gather_kv_rows
page_slots = reference.page_slots
race_sample = _sampling_ops.race_sample
argmax_rows = _sampling_ops.argmax_rows  # twin in native/reference_sampling.py
race_exponentials = _sampling_ops.race_exponentials
random_uniform = _sampling_ops.random_uniform
checksum = _small_ops.checksum
dequantize_fp8_blocks = _fp8_ops.dequantize_fp8_blocks
quantize_pack_int8_rows = _quant_ops.quantize_pack_int8_rows
