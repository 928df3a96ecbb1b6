"""Oracles shared by several suites (imported as `oracles`): the plain model's teacher-forced
logprobs, and the one-row-at-a-time sampler."""

import torch

from control.sampling_params import SamplingParams
from model.batch import ForwardBatch
from native import reference_sampling
from runtime.penalties import PastTokens, process_logits
from runtime.sampling import filter_probs


def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log_softmax (float64) at every position, in one forward: row p predicts
    ids[p + 1]."""
    pool = model.new_kv_pool(num_pages=-(-len(ids) // 16), page_size=16)
    table = pool.new_table()
    pool.reserve(table, len(ids))
    batch = ForwardBatch.build(pool, [table], [ids], [0], is_decode=False)
    batch.extra_logit_index = torch.arange(len(ids))
    return torch.log_softmax(model.forward(batch, pool)[1:].double(), -1)


def sample_rows_one_by_one(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int | None],
    draws: list[int],
    past: PastTokens | None = None,
) -> list[int]:
    """runtime.sampling.sample's contract, one row at a time: each row alone through the same
    logits math (`process_logits`, `filter_probs`), its token from the plain-torch twin of the
    race (`native.reference_sampling`) instead of the batched native call."""
    tokens = []
    for i, p in enumerate(params):
        row = process_logits(
            logits[i : i + 1].float(), [p], None if past is None else _row(past, i)
        )
        if p.is_greedy:
            tokens.append(int(row.argmax(-1)))
            continue
        seed, draw = torch.tensor([seeds[i]]), torch.tensor([draws[i]])
        token = int(reference_sampling.race_sample(filter_probs(row, [p]), seed, draw))
        tokens.append(token if token >= 0 else int(row.argmax(-1)))  # nothing left: greedy
    return tokens


def _row(past: PastTokens, i: int) -> PastTokens:
    """Row i of a step's past, as a one-row step's."""
    mine = past.rows == i
    return PastTokens(
        [past.num_generated[i]],
        [past.stop_ids[i]],
        torch.zeros(int(mine.sum()), dtype=torch.long),
        past.token_ids[mine],
        past.output_counts[mine],
    )
