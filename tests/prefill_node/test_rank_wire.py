"""What rank 0 of a tensor-parallel prefill node broadcasts before each forward
(`prefill_node.ranks`): a ForwardBatch as msgpack (no pickle), which the other ranks rebuild
field for field, an empty prefix and the prompt-logprob rows included; a field it does not
know is refused."""

import msgpack
import pytest
import torch

from model.batch import ForwardBatch
from model.kv_pool import KVPool
from prefill_node.ranks import BATCH_TENSORS, decode_forward, encode_forward


def _batch(prefix: int, extra: bool) -> ForwardBatch:
    pool = KVPool(2, num_pages=8, page_size=4, row_width=8, dtype=torch.float32)
    tables = [pool.new_table() for _ in range(2)]
    for table in tables:
        pool.reserve(table, prefix + 6)
    batch = ForwardBatch.build(
        pool, tables, [[1, 2, 3], [4, 5, 6, 7, 8, 9]], [prefix, prefix], is_decode=False
    )
    if extra:
        batch.extra_logit_index = torch.tensor([0, 4])
    return batch


@pytest.mark.parametrize("prefix, extra", [(0, False), (5, True)])
def test_a_batch_crosses_field_for_field(prefix, extra):
    sent = _batch(prefix, extra)
    got = decode_forward(msgpack.unpackb(encode_forward(sent), raw=False))
    assert got.is_decode == sent.is_decode
    for name in BATCH_TENSORS:
        want, have = getattr(sent, name), getattr(got, name)
        if want is None:
            assert have is None, name
        else:
            assert have.dtype == want.dtype and torch.equal(have, want), name
    assert (got.prefix_slots.numel() == 0) == (prefix == 0)


def test_an_unknown_field_is_refused():
    body = msgpack.unpackb(encode_forward(_batch(0, False)), raw=False)
    body["tensors"]["weights"] = ["torch.int64", [1], b"\0" * 8]
    with pytest.raises(ValueError, match="unknown batch field 'weights'"):
        decode_forward(body)
