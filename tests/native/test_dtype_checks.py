"""The kernels check the dtype of every raw pointer they are handed: a wrapper mistake (a tensor
of another dtype) is a clear error naming the op and the argument, not memory misread."""

import pytest
import torch

from native import _C, ops
from native._tags import tags

pytestmark = pytest.mark.skipif(_C is None, reason="native extension not built")


def test_linear_refuses_a_tensor_of_another_dtype():
    w = ops.prepack_linear(torch.randn(64, 32).to(torch.bfloat16))
    x = torch.randn(1, 32).to(torch.bfloat16)
    y = torch.empty(1, 64, dtype=torch.bfloat16)
    args = (x.data_ptr(), 1, 32, 16, w.packed.data_ptr(), 64, y.data_ptr(), 64)
    _C.linear_bf16(*args, tags(x, w.packed, y))  # the right tags: runs
    torch.testing.assert_close(y.float(), ops.linear(x, w).float())
    bad = torch.empty(1, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="linear_bf16: y is float32, expected bfloat16"):
        _C.linear_bf16(*args, tags(x, w.packed, bad))
    with pytest.raises(ValueError, match="2 dtype tags for 3 tensors"):
        _C.linear_bf16(*args, tags(x, y))
    with pytest.raises(ValueError, match="x is float8_e4m3fn, expected bfloat16"):
        _C.linear_bf16(*args, tags(x.to(torch.float8_e4m3fn), w.packed, y))
    with pytest.raises(ValueError, match="x is a dtype the kernels do not know"):
        _C.linear_bf16(*args, tags(x.view(torch.int16), w.packed, y))


def test_moe_and_bmm_check_theirs():
    zero, bf = 0, torch.zeros(2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fused_moe_bf16: topk_ids is int64, expected int32"):
        _C.fused_moe_bf16(
            zero,
            0,
            2,
            1,
            zero,
            zero,
            1,
            32,
            2,
            zero,
            zero,
            1,
            0,
            zero,
            2,
            tags(bf, bf, bf, torch.zeros(1), torch.zeros(1, dtype=torch.int64), bf),
        )
    with pytest.raises(ValueError, match="bmm_bf16: b is float32, expected bfloat16"):
        _C.bmm_bf16(zero, 0, 0, 1, 2, 2, zero, 2, 2, 4, 2, zero, tags(bf, torch.zeros(1), bf))
    with pytest.raises(ValueError, match="bmm_packed_bf16: out is float32, expected bfloat16"):
        _C.bmm_packed_bf16(zero, 0, 0, 1, 2, 2, zero, 2, zero, tags(bf, bf, torch.zeros(1)))
