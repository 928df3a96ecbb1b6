"""The batched logprob/top-k op against torch.log_softmax, row by row."""

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
