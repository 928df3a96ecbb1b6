"""Weight quantization of a model: which scheme its projections and experts run in.

`quant` is a per-node choice ("none", "int8", "fp8", "int4"; `None` is "none"), so a bf16 prefill node can
feed an int8 decode node: the KV cache and its wire format stay in the model dtype whatever the
scheme, and attention (the latent KV, `kv_b_proj` and the absorbed W_UK / W_UV), the embedding, the
LM head and the router gate stay in the model dtype too, as in the seeds' CPU deployments.

The LM head has a scheme of its own, `quant_lm_head` (off by default): on, it runs W8A8 int8
(`ops.linear_int8`, as the "int8" scheme's projections) whatever `quant` is, "none" included. At
small-batch decode it is one of the largest matrices read per token (DeepSeek-V2-Lite: 102400 x
2048), so int8 halves those bytes; its error is the int8 rounding of the logits alone (nothing
downstream compounds it), measured in tests/model/test_quant_lm_head.py. `ops.linear_int8` takes
bf16 and fp32 activations, so the head goes int8 in either model dtype (not float16).

- "none": the dtype's kernels (`ops.linear`, `ops.fused_moe`).
- "int8": W8A8. Weights int8 symmetric per output channel, activations quantized per token inside
  the kernel (`ops.linear_int8`, `ops.fused_moe_int8`). An FP8 checkpoint is dequantized to fp32
  and re-quantized per channel.
- "int4": W4A8: 4-bit weights with an fp32 scale per group of INT4_GROUP_SIZE inputs of a row,
  activations quantized per token to int8 (`ops.linear_int4`, `ops.fused_moe_int4`). An FP8
  checkpoint is dequantized to fp32 first, as for int8. A GPTQ 4-bit checkpoint's weights are
  kept as stored when symmetric (`model.gptq`: bit for bit, at the checkpoint's group size);
  other GPTQ forms, and every other scheme, dequantize it.
- "fp8": weight-only e4m3 with 128x128 block scales, converted to bf16 in registers
  (`ops.linear_fp8`, `ops.fused_moe_fp8`). An FP8 checkpoint's weights are kept as stored (its
  blocks must be 128x128; a fused gate|up projection whose gate rows are not whole blocks is
  zero-padded to them); a bf16 checkpoint is block-quantized at load.

The attention projections (q_proj / q_a_proj / q_b_proj / kv_a_proj_with_mqa / o_proj, and the
MTP layer's eh_proj, which loads as they do) have a scheme of their own, `attention_scheme`: the
node's `quant_attention` when set, else `quant`'s, but "int8" under "int4" (their error feeds
the KV cache and every later token; `control.quant_schemes.attention_scheme`). A quantizer of
that scheme packs them, so any of the four goes with any `quant`: "int4" MLPs with attention in
the model dtype, or everything in 4 bits. Its FP8 and GPTQ inputs are handled as in its scheme
above (dequantized by "none", kept by "fp8", a symmetric GPTQ one kept by "int4").

A `Quantizer` turns the weights the loader hands over (`torch.Tensor`, or `Fp8Weight` /
`GptqWeight` from an FP8 or GPTQ checkpoint) into callables: `Linear` (x -> x W^T) and `Experts` (the routed experts). The
weights come one at a time and each is released once packed (model.checkpoint_reader).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from control.errors import ConfigError
from control.quant_schemes import (
    INT4_GROUP_SIZE,
    QUANT_SCHEMES,
    attention_scheme,
    lm_head_scheme,
    parse_quant,
)
from model.checkpoint_reader import Fp8Weight
from model.gptq import GptqWeight
from native import ops

__all__ = ["QUANT_SCHEMES", "Experts", "Linear", "QuantizationError", "Quantizer", "quantizer"]
FP8_KERNEL_BLOCK = (128, 128)  # the fp8 kernels' scale blocks (native/reference.py FP8_BLOCK)

Source = torch.Tensor | Fp8Weight | GptqWeight  # one matrix as the loader hands it over
Loader = Callable[[], Source]  # a matrix read when called (one expert at a time)


class QuantizationError(ConfigError):
    """The checkpoint cannot run in the requested scheme (the message names the key)."""


class Linear:
    """y = x W^T with W packed for one scheme; `weight` is what the op takes."""

    __slots__ = ("weight", "_op")

    def __init__(self, weight, op: Callable[[torch.Tensor, object], torch.Tensor]):
        self.weight, self._op = weight, op

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.weight)


class Experts:
    """The routed experts of one MoE layer: (x [T, D], weights [T, K], ids [T, K], offset) ->
    [T, D]; `w13` / `w2` are what the fused-MoE op takes."""

    __slots__ = ("w13", "w2", "_op")

    def __init__(self, packed: tuple, op):
        (self.w13, self.w2), self._op = packed, op

    def __call__(self, x, topk_weights, topk_ids, expert_offset: int = 0) -> torch.Tensor:
        return self._op(x, self.w13, self.w2, topk_weights, topk_ids, expert_offset)


def as_tensor(source: Source, dtype: torch.dtype) -> torch.Tensor:
    """A matrix in `dtype` whatever the loader handed over."""
    if isinstance(source, (Fp8Weight, GptqWeight)):
        return source.dequantize(dtype)
    return source.to(dtype)


class Quantizer:
    """Scheme "none": the model dtype's kernels. Subclasses override `_pack_linear`,
    `_pack_experts` and their ops. `name` is the scheme of the MLPs and experts,
    `attention_scheme` the attention projections' (packed by a quantizer of that scheme),
    `head_scheme` the LM head's ("none": the model dtype, "int8"); see the module."""

    name = "none"
    key = "quant"  # the config key that chose this scheme, for messages
    _reads_stored = False  # the scheme quantizes FP8 / GPTQ weights from their stored form

    def __init__(
        self,
        dtype: torch.dtype,
        quant_lm_head: bool = False,
        quant_attention: str | None = None,
    ):
        self.dtype = dtype
        self.head_scheme = lm_head_scheme(quant_lm_head)
        self.attention_scheme = attention_scheme(self.name, quant_attention)
        if self.attention_scheme == self.name:
            self._attention = self
        else:  # one of that scheme's own, whose attention is itself
            scheme = self.attention_scheme
            self._attention = _SCHEMES[scheme](dtype, quant_attention=scheme)
            self._attention.key = "quant_attention"  # its errors name the key that chose it

    @property
    def keeps_stored(self) -> bool:
        """Whether the loader hands FP8 and GPTQ weights over as stored (`CheckpointReader`):
        when either class's scheme reads them so; "none" dequantizes what it gets itself."""
        return self._reads_stored or self._attention._reads_stored

    def linear(self, *parts: Source) -> Linear:
        """The projection of `parts` stacked by rows (gate and up: one GEMM) in this scheme, an
        MLP's; an attention projection is `attention`'s."""
        return Linear(self._pack_linear(list(parts)), self._linear_op)

    def attention(self, *parts: Source) -> Linear:
        """An attention projection of `parts` stacked by rows, in `attention_scheme`."""
        return self._attention.linear(*parts)

    def gated_mlp(self, gate: Source, up: Source, down: Source) -> tuple[Linear, Linear]:
        """(w13, w2) of down(silu(gate(x)) * up(x)): gate and up stacked into one GEMM."""
        return self.linear(gate, up), self.linear(down)

    def dense(self, source: Source) -> Linear:
        """A projection kept in the model dtype whatever the scheme (kv_b_proj; the LM head
        unless `head_scheme` is "int8")."""
        return Linear(ops.prepack_linear(as_tensor(source, self.dtype)), ops.linear)

    def head(self, source: Source) -> Linear:
        """The LM head: `dense`, or W8A8 int8 per output row (one scale per vocabulary entry)
        when `head_scheme` is "int8", whatever this scheme is."""
        if self.head_scheme == "int8":
            # A float checkpoint's head is quantized from its own dtype (no fp32 copy of the
            # largest matrix), an FP8 one's from fp32, as the int8 scheme's projections.
            return Linear(ops.prepack_linear_int8(_stacked([source])), ops.linear_int8)
        return self.dense(source)

    def experts(self, w13: list[Loader], w2: list[Loader]) -> Experts:
        """Routed experts from per-expert loaders: w13 returns (gate, up), w2 the down matrix."""
        return Experts(self._pack_experts(w13, w2), self._moe_op)

    # the ops around weights packed before (a mapped pack, model.weight_source) ------------
    def wrap_linear(self, packed) -> Linear:
        """The projection of a weight this scheme packed (`linear(...).weight`)."""
        return Linear(packed, self._linear_op)

    def wrap_attention(self, packed) -> Linear:
        """The attention projection of a weight `attention` packed (in `attention_scheme`)."""
        return self._attention.wrap_linear(packed)

    def attention_key(self, names: tuple[str, ...]) -> str:
        """The pack key of the attention projection of checkpoint tensors `names`: `linear:`
        when it runs in this scheme's default (`attention_scheme(name)`, as in packs made
        before the attention had a scheme of its own), else naming its scheme, so a pack of
        one is never read as the other even past its spec check (`PackSpec.attention`)."""
        default = attention_scheme(self.name) == self.attention_scheme
        kind = "linear" if default else f"linear_{self.attention_scheme}"
        return f"{kind}:{'+'.join(names)}"

    def wrap_dense(self, packed) -> Linear:
        """The model-dtype projection of a weight `dense` packed."""
        return Linear(packed, ops.linear)

    def wrap_head(self, packed) -> Linear:
        """The LM head of a weight `head` packed (in `head_scheme`)."""
        if self.head_scheme == "int8":
            return Linear(packed, ops.linear_int8)
        return self.wrap_dense(packed)

    def head_key(self, name: str) -> str:
        """The pack key of the head read from checkpoint tensor `name`: the int8 head's differs
        from the model-dtype one's (`dense:`), so a pack of one is never read as the other even
        past its spec check (model.weight_pack.PackSpec.lm_head)."""
        return f"head_int8:{name}" if self.head_scheme == "int8" else f"dense:{name}"

    def wrap_experts(self, packed: tuple) -> Experts:
        """The routed experts of (w13, w2) as this scheme packed them."""
        return Experts(packed, self._moe_op)

    # the scheme ------------------------------------------------------------------------------
    _linear_op = staticmethod(ops.linear)
    _moe_op = staticmethod(ops.fused_moe)

    def _pack_linear(self, parts: list[Source]):
        return ops.prepack_linear(_stacked(parts, self.dtype))

    def _pack_experts(self, w13: list[Loader], w2: list[Loader]):
        return ops.prepack_experts(
            [_matrix_loader(load, self.dtype) for load in w13],
            [_matrix_loader(load, self.dtype) for load in w2],
        )


class Int8Quantizer(Quantizer):
    """W8A8: per-channel int8 weights (an FP8 checkpoint's dequantized to fp32 first, so it
    loses no more than its own rounding), per-token int8 activations."""

    name = "int8"
    _reads_stored = True
    _linear_op = staticmethod(ops.linear_int8)
    _moe_op = staticmethod(ops.fused_moe_int8)

    def _pack_linear(self, parts: list[Source]):
        return ops.prepack_linear_int8(_stacked(parts))

    def _pack_experts(self, w13, w2):
        return ops.prepack_experts_int8(
            [_matrix_loader(f) for f in w13], [_matrix_loader(f) for f in w2]
        )


class Int4Quantizer(Quantizer):
    """W4A8: per-group int4 weights (a symmetric GPTQ checkpoint's as stored, anything else
    quantized from floats), per-token int8 activations. Its attention projections run W8A8 int8
    unless the node's `quant_attention` says otherwise (see the module)."""

    name = "int4"
    _reads_stored = True
    _linear_op = staticmethod(ops.linear_int4)
    _moe_op = staticmethod(ops.fused_moe_int4)

    def _pack_linear(self, parts: list[Source]):
        return ops.prepack_linear_int4(_int4_or_float(parts), INT4_GROUP_SIZE)

    def _pack_experts(self, w13, w2):
        def expert(load: Loader) -> Callable[[], torch.Tensor | ops.Int4Weight]:
            return lambda: _int4_or_float(_parts(load()))

        return ops.prepack_experts_int4(
            [expert(f) for f in w13], [expert(f) for f in w2], INT4_GROUP_SIZE
        )


class Fp8Quantizer(Quantizer):
    """Weight-only FP8 e4m3, 128x128 block scales; an FP8 checkpoint's weights kept as stored."""

    name = "fp8"
    _reads_stored = True
    _linear_op = staticmethod(ops.linear_fp8)
    _moe_op = staticmethod(ops.fused_moe_fp8)

    def _pack_linear(self, parts: list[Source]):
        if all(isinstance(p, Fp8Weight) for p in parts):
            return ops.prepack_linear_fp8(*_stacked_fp8(parts, key=self.key))
        return ops.prepack_linear_fp8_from(_stacked(parts))

    def gated_mlp(self, gate: Source, up: Source, down: Source) -> tuple[Linear, Linear]:
        """From an FP8 checkpoint whose intermediate size I is not a multiple of 128 (a small
        model's), gate and up are zero-padded to whole 128-row blocks and down to as many
        columns: their block scales do not change (ceil(I/128) blocks either way), the padded
        units compute silu(0) * 0 = 0 and down's zero columns add nothing, so the result is
        exact and the stored bytes are kept."""
        fp8 = all(isinstance(w, Fp8Weight) for w in (gate, up, down))
        rows = gate.weight.shape[0] if fp8 else 0
        pad = -rows % FP8_KERNEL_BLOCK[0]
        if fp8 and pad:
            gate, up = (_pad_fp8(w, rows=pad) for w in (gate, up))
            down = _pad_fp8(down, cols=pad)
        return super().gated_mlp(gate, up, down)

    def _pack_experts(self, w13, w2):
        def expert(load: Loader) -> Loader:
            def read():
                parts = _parts(load())
                if all(isinstance(p, Fp8Weight) for p in parts):
                    # gate and up keep their own blocks (the kernel's halves): any I works
                    return _stacked_fp8(parts, whole_blocks=False)
                return _stacked(parts)

            return read

        return ops.prepack_experts_fp8([expert(f) for f in w13], [expert(f) for f in w2])


def _parts(loaded) -> list[Source]:
    """What a loader returned, as a list: (gate, up), or one matrix (an Fp8Weight is a tuple)."""
    return [loaded] if isinstance(loaded, Source) else list(loaded)


def _stacked(parts: list[Source], dtype: torch.dtype | None = None) -> torch.Tensor:
    """The parts stacked by rows in `dtype` (default: `_float_dtype`)."""
    tensors = [as_tensor(p, dtype or _float_dtype(parts)) for p in parts]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _matrix_loader(load: Loader, dtype: torch.dtype | None = None) -> Loader:
    """An expert loader whose matrix comes out stacked (`_stacked`) in `dtype`."""
    return lambda: _stacked(_parts(load()), dtype)


def _int4_or_float(parts: list[Source]) -> torch.Tensor | ops.Int4Weight:
    """The parts stacked by rows: in our int4 form as stored when every part is a GPTQ weight
    that has one (`GptqWeight.as_int4`: symmetric, inputs in group order) of one group size, so
    the checkpoint's 4 bits are kept exactly; else as floats (`_stacked`), to quantize."""
    forms = [p.as_int4() if isinstance(p, GptqWeight) else None for p in parts]
    if any(f is None for f in forms) or len({f.group_size for f in forms}) != 1:
        return _stacked(parts)
    if len(forms) == 1:
        return forms[0]
    qweight = torch.cat([f.qweight for f in forms])
    return ops.Int4Weight(qweight, torch.cat([f.scale for f in forms]), forms[0].group_size)


def _float_dtype(parts: list[Source]) -> torch.dtype:
    """What int8 (or fp8 from a float checkpoint) quantizes from: a float checkpoint's own
    dtype (no fp32 copy of a whole matrix while loading: the quantizers upcast a block of rows at
    a time), an FP8 checkpoint dequantized to fp32."""
    if any(isinstance(p, (Fp8Weight, GptqWeight)) for p in parts):
        return torch.float32
    return parts[0].dtype


def _check_kernel_block(w: Fp8Weight, key: str = "quant") -> None:
    if tuple(w.block) != FP8_KERNEL_BLOCK:
        raise QuantizationError(
            f'{key} = "fp8": the checkpoint\'s FP8 blocks are {list(w.block)} (tensor '
            f"'{w.name}'); the fp8 kernels take 128x128 blocks as stored. Use {key} = "
            f'"int8" or "none" (both dequantize it)'
        )


def _pad_fp8(w: Fp8Weight, rows: int = 0, cols: int = 0) -> Fp8Weight:
    """w with `rows` zero rows / `cols` zero columns appended inside its last block (the scales
    keep their shape: the caller pads within one block)."""
    raw = torch.nn.functional.pad(w.weight.view(torch.uint8), (0, cols, 0, rows))  # fp8 0 = 0x00
    return w._replace(weight=raw.view(torch.float8_e4m3fn))


def _stacked_fp8(
    parts: list[Fp8Weight], whole_blocks: bool = True, key: str = "quant"
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 matrices stacked by rows with their scales. For one linear (`whole_blocks`) every part
    but the last must end on a block boundary, or a block would mix two matrices' scales; the
    experts' kernel keeps each half's blocks apart and takes any row count."""
    for p in parts:
        _check_kernel_block(p, key)
    for p in parts[:-1] if whole_blocks else ():
        rows = p.weight.shape[0]
        if rows % FP8_KERNEL_BLOCK[0]:
            raise QuantizationError(
                f"{key} = \"fp8\": tensor '{p.name}' has {rows} rows, not a multiple of the "
                f"{FP8_KERNEL_BLOCK[0]}-row FP8 blocks, so it cannot share one block-scaled "
                f'matrix with the next projection as stored. Use {key} = "int8" or "none"'
            )
    if len(parts) == 1:
        return parts[0].weight, parts[0].scale_inv
    return torch.cat([p.weight for p in parts]), torch.cat([p.scale_inv for p in parts])


_SCHEMES = {"none": Quantizer, "int8": Int8Quantizer, "fp8": Fp8Quantizer, "int4": Int4Quantizer}


# What `ops.linear_int8` takes as activations: the int8 head's model dtypes.
_INT8_HEAD_DTYPES = (torch.bfloat16, torch.float32)


def quantizer(
    quant: str | None,
    dtype: torch.dtype,
    quant_lm_head: bool = False,
    quant_attention: str | None = None,
) -> Quantizer:
    """The Quantizer of `quant` (None = "none") for a model in `dtype`; int8, int4 and fp8 need bf16
    (their kernels take bf16 activations). `quant_attention`: the attention projections' scheme
    (None: `quant`'s, "int8" under "int4"; see the module). `quant_lm_head`: the LM head in
    int8 (see the module), in a bf16 or fp32 model."""
    name = parse_quant(quant)
    attention = attention_scheme(name, quant_attention)
    for key, scheme in (("quant", name), ("quant_attention", attention)):
        if scheme != "none" and dtype != torch.bfloat16:
            raise QuantizationError(
                f'{key} = "{scheme}" needs dtype bfloat16 (its kernels take bf16 activations), '
                f"got {str(dtype).removeprefix('torch.')}"
            )
    if not isinstance(quant_lm_head, bool):
        raise QuantizationError(f"quant_lm_head must be true or false, got {quant_lm_head!r}")
    if quant_lm_head and dtype not in _INT8_HEAD_DTYPES:
        raise QuantizationError(
            "quant_lm_head = true needs dtype bfloat16 or float32 (the int8 kernel takes those "
            f"activations), got {str(dtype).removeprefix('torch.')}"
        )
    return _SCHEMES[name](dtype, quant_lm_head, quant_attention)
