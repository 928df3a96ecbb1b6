"""dtype tags of native/csrc/common.h's `DType`: what the wrappers pass with every raw pointer, so
a kernel checks the dtype of what it is handed (`check_dtypes`) instead of misreading it."""

from __future__ import annotations

import torch

DTYPE_TAGS = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.int32: 3,
    torch.int64: 4,
    torch.int8: 5,
    torch.float8_e4m3fn: 6,
    torch.uint8: 7,
}
UNKNOWN = -1  # a dtype the kernels have no tag for: every check refuses it


def tags(*tensors: torch.Tensor) -> list[int]:
    """The tag of each tensor's dtype, in order."""
    return [DTYPE_TAGS.get(t.dtype, UNKNOWN) for t in tensors]
