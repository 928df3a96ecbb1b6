"""Plain-model oracles shared by the suites that check logprobs (imported as `oracles`)."""

import torch

from engine.batch import ForwardBatch


def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log_softmax (float64) at every position, in one forward: row p predicts
    ids[p + 1]."""
    pool = model.new_kv_pool(num_pages=-(-len(ids) // 16), page_size=16)
    table = pool.new_table()
    pool.reserve(table, len(ids))
    batch = ForwardBatch.build(pool, [table], [ids], [0], is_decode=False)
    batch.extra_logit_index = torch.arange(len(ids))
    return torch.log_softmax(model.forward(batch, pool)[1:].double(), -1)
