"""The batched logprob/top-k op against torch.log_softmax, row by row; ranks against a count
over logits whose order is exact."""

import pytest
import torch

from runtime.logprobs import token_logprobs

ATOL = 1e-5  # fp32 vs an fp64 reference: values near -20 hold ~2e-6 of rounding


@pytest.mark.parametrize("vocab", [1, 19, 4096 + 13])
def test_rows_that_ask_get_log_softmax_and_top_k(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen) * 4
    tokens = torch.randint(0, vocab, (5,), generator=gen).tolist()
    num_top = [None, 0, min(3, vocab), None, min(20, vocab)]
    out = token_logprobs(logits, tokens, num_top)
    for row, (lp, k) in enumerate(zip(out, num_top, strict=True)):
        if k is None:
            assert lp is None
            continue
        ref = torch.log_softmax(logits[row].double(), -1)
        assert lp.logprob == pytest.approx(ref[tokens[row]].item(), abs=ATOL)
        assert len(lp.top_ids) == len(lp.top_logprobs) == k
        ref_top = ref.topk(k)
        assert lp.top_logprobs == pytest.approx(ref_top.values.tolist(), abs=ATOL)
        assert [ref[t].item() for t in lp.top_ids] == pytest.approx(lp.top_logprobs, abs=ATOL)


def test_no_row_asks():
    assert token_logprobs(torch.randn(2, 7), [1, 2], [None, None]) == [None, None]


def test_the_rank_counts_the_tokens_at_least_as_likely():
    """Distinct logits 0.01 apart (no rounding can reorder them), then a tie: vLLM's count
    includes every token at least as likely, the chosen one too."""
    gen = torch.Generator().manual_seed(1)
    vocab = 777
    logits = torch.randperm(vocab, generator=gen).float()[None].repeat(4, 1) * 0.01
    tokens = [0, 5, 400, 776]
    out = token_logprobs(logits, tokens, [0, 2, None, 20], ranks=True)
    for row, lp in enumerate(out):
        if lp is None:
            continue
        expected = int((logits[row] >= logits[row, tokens[row]]).sum())
        assert lp.rank == expected
    assert {lp.rank for lp in out if lp is not None} != {out[0].rank}  # not all alike
    best = int(logits[0].argmax())
    tied = logits.clone()
    tied[0, 3] = tied[0, best]
    (lp,) = token_logprobs(tied[:1], [best], [1], ranks=True)
    assert lp.rank == 2  # the best token and its tie
