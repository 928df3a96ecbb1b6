"""Attention kernels (extend_attention, mla_decode) against their plain-torch twins in
native.reference, on every ISA level (the `isa` fixture)."""

import pytest
import torch

from native import ops, reference

DTYPES = [torch.float32, torch.bfloat16]
# fp32: sums in another order. bf16: the kernels round the probabilities to bf16 before P V
# (the reference keeps them fp32), which moves an output by about one bf16 step.
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOL[expected.dtype])


# ---- extend_attention ------------------------------------------------------------------------


def _extend_inputs(new_lens, prefix_lens, heads, dqk, dv, dtype, seed=0, q_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    num_new, num_prefix = sum(new_lens), sum(prefix_lens)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    return dict(
        q=rand(num_new, heads, dqk, scale=q_scale),
        k=rand(num_new, heads, dqk),
        v=rand(num_new, heads, dv),
        k_prefix=rand(num_prefix, heads, dqk),
        v_prefix=rand(num_prefix, heads, dv),
        new_lens=torch.tensor(new_lens, dtype=torch.int64),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64),
        sm_scale=dqk**-0.5,
    )


EXTEND_CASES = {
    "one_token": ([1], [0], 2, 24, 16),
    "one_token_after_prefix": ([1], [5], 2, 24, 16),
    "odd_lengths_and_empty_entries": ([7, 0, 13], [0, 9, 0], 2, 24, 16),
    "no_new_tokens": ([0, 0], [3, 0], 2, 24, 16),
    # DeepSeek prefill dims; 300 crosses the 120-query block and the 256-key tile.
    "deepseek_dims": ([300], [37], 2, 192, 128),
    # Odd head dims (zero-padded VNNI pairs), key counts around the 64-key panel.
    "odd_head_dims": ([65, 130], [257, 64], 3, 17, 33),
    "head_dim_256": ([40], [23], 1, 256, 256),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", EXTEND_CASES.values(), ids=EXTEND_CASES.keys())
def test_extend_attention(isa, dtype, case):
    new_lens, prefix_lens, heads, dqk, dv = case
    args = _extend_inputs(new_lens, prefix_lens, heads, dqk, dv, dtype)
    _close(ops.extend_attention(**args), reference.extend_attention(**args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_attention_batch_64(isa, dtype):
    g = torch.Generator().manual_seed(1)
    new_lens = torch.randint(0, 20, (64,), generator=g).tolist()
    prefix_lens = torch.randint(0, 40, (64,), generator=g).tolist()
    args = _extend_inputs(new_lens, prefix_lens, 2, 24, 16, dtype)
    _close(ops.extend_attention(**args), reference.extend_attention(**args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_attention_peaked_softmax(isa, dtype):
    """Large scores: the running max must be updated without overflow or lost mass."""
    args = _extend_inputs([90], [150], 2, 64, 32, dtype, q_scale=30.0)
    _close(ops.extend_attention(**args), reference.extend_attention(**args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_attention_strided_views(isa, dtype):
    """q, k, v as views of larger tensors (head-major storage, a slice of a fused kv)."""
    args = _extend_inputs([33, 20], [17, 0], 4, 40, 24, dtype, seed=2)
    num_new, heads = 53, 4
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(num_new, heads, 40 + 24, generator=g).to(dtype)
    args["k"], args["v"] = kv[..., :40], kv[..., 40:]
    args["q"] = args["q"].transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D] head-major
    assert not args["q"].is_contiguous() and not args["k"].is_contiguous()
    _close(ops.extend_attention(**args), reference.extend_attention(**args))


def test_extend_attention_checks_lengths(isa):
    args = _extend_inputs([4], [2], 2, 24, 16, torch.float32)
    args["new_lens"] = torch.tensor([5])
    with pytest.raises(ValueError, match="new_lens"):
        ops.extend_attention(**args)
    args = _extend_inputs([4], [2], 2, 24, 16, torch.float32)
    args["k_prefix"] = args["k_prefix"][:, :1]
    with pytest.raises(ValueError, match="k_prefix"):
        ops.extend_attention(**args)


def test_extend_attention_falls_back_on_float16(isa):
    args = _extend_inputs([5], [3], 2, 24, 16, torch.float16)
    torch.testing.assert_close(
        ops.extend_attention(**args), reference.extend_attention(**args), rtol=0, atol=0
    )


# ---- mla_decode --------------------------------------------------------------------------------


def _decode_inputs(seq_lens, heads, rank, rope, page_size, dtype, with_new_rows, seed=0):
    """A cache whose pages are handed out in a shuffled order, plus spare pages."""
    g = torch.Generator().manual_seed(seed)
    width = rank + rope
    max_pages = max(1, max((n + page_size - 1) // page_size for n in seq_lens))
    num_pages = len(seq_lens) * max_pages + 2
    table = torch.randperm(num_pages, generator=g)[: len(seq_lens) * max_pages]
    return dict(
        q=torch.randn(len(seq_lens), heads, width, generator=g).to(dtype),
        kv_cache=torch.randn(num_pages, page_size, width, generator=g).to(dtype),
        page_table=table.view(len(seq_lens), max_pages).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        sm_scale=width**-0.5,
        kv_lora_rank=rank,
        new_rows=torch.randn(len(seq_lens), width, generator=g).to(dtype)
        if with_new_rows
        else None,
    )


def _check_decode(args) -> None:
    ref_args = dict(args, kv_cache=args["kv_cache"].clone())
    expected = reference.mla_decode(**ref_args)
    _close(ops.mla_decode(**args), expected)
    # The same new rows stored (bit for bit; a cache may hold NaN rows past the lengths).
    torch.testing.assert_close(
        args["kv_cache"], ref_args["kv_cache"], rtol=0, atol=0, equal_nan=True
    )


DECODE_CASES = {
    "one_token": ([1], 16, 512, 64),
    "empty_entry_and_odd_lengths": ([5, 0, 300], 16, 512, 64),
    # 127/128/129 sit at the 128-token chunk boundary, 64/65 at a page boundary.
    "chunk_and_page_boundaries": ([64, 65, 127, 128, 129], 16, 512, 64),
    "tiny_model_rows": ([7, 33, 130], 4, 32, 8),
    # 20 heads: two head vectors; 3 heads: one mostly empty vector.
    "twenty_heads": ([70, 200], 20, 64, 16),
    "three_heads_odd_width": ([19, 40], 3, 17, 4),
    # Widths and ranks of multiples of 32 take the AMX path where the CPU has it: one head block
    # of few heads, two head blocks, and chunks of 1..4 blocks of 32 rows.
    "tiles_three_heads": ([19, 40, 97], 3, 256, 32),
    "tiles_twenty_heads": ([70, 200, 33], 20, 512, 64),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_mla_decode(isa, dtype, page_size, case):
    seq_lens, heads, rank, rope = case
    _check_decode(_decode_inputs(seq_lens, heads, rank, rope, page_size, dtype, True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [3, 16, 64])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_mla_decode_ignores_rows_past_the_length(isa, dtype, page_size, poison):
    """The rows of a sequence's pages past its length (and the unused pages) hold anything: a
    kernel that reads a whole 16-row group of a page must not let them into the output."""
    seq_lens = [19, 40, 97, 128]
    args = _decode_inputs(seq_lens, 16, 512, 64, page_size, dtype, True)
    cache, table = args["kv_cache"], args["page_table"]
    used = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for b, length in enumerate(seq_lens):
        for pos in range(length):
            used[table[b, pos // page_size], pos % page_size] = True
    cache[~used] = poison
    out = ops.mla_decode(**dict(args, kv_cache=cache.clone()))
    assert torch.isfinite(out).all()
    _check_decode(args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_decode_without_new_rows(isa, dtype):
    _check_decode(_decode_inputs([50, 1, 0], 16, 64, 16, 16, dtype, False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_mla_decode_split_sequences(isa, dtype, num_threads):
    """Few sequences, long contexts: every sequence is cut into KV splits merged by log-sum-exp."""
    previous = torch.get_num_threads()
    ops.set_num_threads(num_threads)
    try:
        _check_decode(_decode_inputs([1000], 16, 512, 64, 64, dtype, True))
        _check_decode(_decode_inputs([700, 90], 16, 64, 16, 16, dtype, True, seed=1))
    finally:
        ops.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 3])
def test_mla_decode_unsplit_multi_chunk_sequences(isa, dtype, page_size):
    """One thread and as many sequences as threads x 2: no KV splits, so one task runs several
    128-row chunks; a last chunk of 121..128 rows once spilled zeros over the running output."""
    previous = torch.get_num_threads()
    ops.set_num_threads(1)
    try:
        for seq_lens in ([250, 1], [5, 300], [256, 256]):
            _check_decode(_decode_inputs(seq_lens, 16, 512, 64, page_size, dtype, True))
    finally:
        ops.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_decode_batch_64(isa, dtype):
    g = torch.Generator().manual_seed(4)
    seq_lens = torch.randint(0, 150, (64,), generator=g).tolist()
    _check_decode(_decode_inputs(seq_lens, 8, 32, 8, 16, dtype, True))


def test_mla_decode_checks_pages_and_lengths(isa):
    args = _decode_inputs([10, 20], 4, 32, 8, 16, torch.float32, True)
    args["page_table"][1, 0] = args["kv_cache"].shape[0]  # past the last page
    with pytest.raises(ValueError, match="page_table"):
        ops.mla_decode(**args)
    args = _decode_inputs([10, 20], 4, 32, 8, 16, torch.float32, True)
    args["seq_lens"] = torch.tensor([10, 17 * 16], dtype=torch.int32)  # more than its pages
    with pytest.raises(ValueError, match="seq_lens"):
        ops.mla_decode(**args)
    args = _decode_inputs([10, 20], 4, 32, 8, 16, torch.float32, True)
    args["q"] = args["q"][..., :30]
    with pytest.raises(ValueError, match="mla_decode: q"):
        ops.mla_decode(**args)


def test_mla_decode_strided_cache_falls_back(isa):
    """A cache view that is not contiguous cannot be written in place by the kernel."""
    args = _decode_inputs([12, 3], 4, 32, 8, 4, torch.float32, True)
    args["kv_cache"] = torch.cat((args["kv_cache"], args["kv_cache"]), dim=1)[:, ::2]
    _check_decode(args)
