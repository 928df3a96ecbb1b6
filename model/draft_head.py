"""The LM head the MTP layer drafts with: the main head, or a copy of it in fewer bits.

A draft only proposes a token: the verify pass scores it with the main model's own head, and
greedy acceptance keeps a draft only where it equals the target's choice (rejection sampling
likewise reads the target's probabilities alone). So the draft head's precision can change how
often drafts are accepted, never what is emitted. Its bytes, though, are paid on every step:
the head is the largest matrix a draft pass reads (DeepSeek-V2-Lite: 102400 x 2048, 420 MB in
bf16, about as much as all of the MTP layer's other weights read for one token), so a 4-bit copy
makes a draft pass much cheaper for one more copy of the head in memory (a quarter of its bf16
size, plus scales).

Schemes (`control.quant_schemes.DRAFT_HEAD_SCHEMES`): "none" drafts with the main head itself;
"int8" with a W8A8 copy (`ops.linear_int8`; the main head itself when it is int8 already,
`quant_lm_head`); "int4" with a W4A8 copy, a scale per group of INT4_GROUP_SIZE inputs
(`ops.linear_int4`).
"""

from __future__ import annotations

import torch

from control.quant_schemes import INT4_GROUP_SIZE, parse_draft_head
from model.quant import Linear
from native import ops, reference


def _is_int8(weight) -> bool:
    return isinstance(weight, (ops.PackedLinearInt8, reference.Int8Weight))


def float_weight(weight) -> torch.Tensor:
    """The head's weight [V, D] as floats, whatever it was packed as."""
    if isinstance(weight, torch.Tensor):
        return weight
    if isinstance(weight, ops.PackedLinear):
        return weight.unpack()
    if _is_int8(weight):
        q, scale = weight.unpack() if isinstance(weight, ops.PackedLinearInt8) else weight
        return q.float() * scale[:, None]
    raise TypeError(f"draft head: cannot read a head packed as {type(weight).__name__}")


def draft_head(head: Linear, scheme: str) -> Linear:
    """The head drafts run through, in `scheme` (see the module); `head` is the main one."""
    scheme = parse_draft_head(scheme)
    if scheme == "none" or (scheme == "int8" and _is_int8(head.weight)):
        return head
    weight = float_weight(head.weight)
    if scheme == "int8":
        return Linear(ops.prepack_linear_int8(weight), ops.linear_int8)
    return Linear(ops.prepack_linear_int4(weight.float(), INT4_GROUP_SIZE), ops.linear_int4)
