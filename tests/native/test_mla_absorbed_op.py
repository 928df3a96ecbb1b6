"""ops.mla_decode_absorbed (native/csrc/mla_absorbed.cpp) on every ISA path: the same bits as the
chain of separate ops it fuses (output and cache), close to its plain-torch twin
(native/reference_mla.py), every check made before the cache is touched, and the fallback."""

from __future__ import annotations

import pytest
import torch

from native import _mla_ops, ops, reference_mla

# The twin sums in fp32 throughout; the kernels round q_latent, the probabilities and the latent
# output to bf16 between steps (as the separate ops do), about one bf16 step of the output.
TOL = dict(rtol=3e-2, atol=3e-2)


def _inputs(seq_lens, heads, nope, rope, rank, v_dim, page_size, seed=0, dtype=torch.bfloat16):
    """Decode rows over a cache whose pages are handed out shuffled; q and kv_a as the
    projections give them: q a [T, H * (nope + rope)] matrix viewed per head."""
    g = torch.Generator().manual_seed(seed)
    tokens, width = len(seq_lens), rank + rope
    max_pages = max((n + page_size - 1) // page_size for n in seq_lens)
    num_pages = tokens * max_pages + 2
    table = torch.randperm(num_pages, generator=g)[: tokens * max_pages].view(tokens, max_pages)
    max_pos = max(seq_lens) + 3
    angles = torch.rand(max_pos, rope // 2, generator=g) * 6.3
    return dict(
        q=torch.randn(tokens, heads * (nope + rope), generator=g)
        .to(dtype)
        .view(tokens, heads, nope + rope),
        kv_a=torch.randn(tokens, width, generator=g).to(dtype),
        kv_a_norm=(torch.rand(rank, generator=g) + 0.5).to(dtype),
        eps=1e-6,
        positions=torch.tensor([n - 1 for n in seq_lens], dtype=torch.int64),
        cos_sin=torch.cat((angles.cos(), angles.sin()), dim=1),
        w_uk=(torch.randn(heads, nope, rank, generator=g) * nope**-0.5).to(dtype),
        w_uv_t=(torch.randn(heads, rank, v_dim, generator=g) * rank**-0.5).to(dtype),
        kv_cache=torch.randn(num_pages, page_size, width, generator=g).to(dtype),
        page_table=table.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        sm_scale=(nope + rope) ** -0.5,
    )


def _packed(args: dict) -> dict:
    return dict(args, w_uk=ops.prepack_bmm(args["w_uk"]), w_uv_t=ops.prepack_bmm(args["w_uv_t"]))


def _strided(cache: torch.Tensor) -> torch.Tensor:
    """The same values as every other row of a cache twice as deep (not contiguous)."""
    return torch.stack((cache, cache), dim=2).flatten(1, 2)[:, ::2]


def _with_cache_copy(args: dict) -> dict:
    cache = args["kv_cache"]
    copy = cache.clone() if cache.is_contiguous() else _strided(cache.contiguous())
    return dict(args, kv_cache=copy)


CASES = {
    "deepseek_one_token": ([512], 16, 128, 64, 512, 128, 16),
    "deepseek_rows_at_chunk_and_page_edges": ([1, 64, 129, 300], 16, 128, 64, 512, 128, 16),
    "three_heads_page_of_one": ([5, 40, 2], 3, 16, 8, 32, 24, 1),
    "tiny_model_odd_pages": ([7, 33, 130], 4, 32, 16, 64, 32, 7),
    "v_not_a_panel": ([20, 90], 2, 16, 8, 32, 40, 16),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_same_bits_as_the_separate_ops_and_close_to_the_twin(isa, case):
    args = _packed(_inputs(*case))
    separate = _with_cache_copy(args)
    twin = _with_cache_copy(dict(_inputs(*case)))  # unpacked weights, the same values
    got = ops.mla_decode_absorbed(**args)
    chained = reference_mla.absorbed_chain(_mla_ops._SEPARATE_OPS, **separate)
    assert got.shape == (len(case[0]), case[1], case[5]) and got.is_contiguous()
    assert torch.equal(got, chained)
    assert torch.equal(args["kv_cache"], separate["kv_cache"])
    expected = reference_mla.mla_decode_absorbed(**twin)
    torch.testing.assert_close(got.float(), expected.float(), **TOL)
    # The new rows ([norm(c_kv) | rope(k_pe)]) land where the twin stores them.
    torch.testing.assert_close(args["kv_cache"].float(), twin["kv_cache"].float(), **TOL)
    changed = (args["kv_cache"] != _inputs(*case)["kv_cache"]).any(-1).sum().item()
    assert changed == len(case[0])


@pytest.mark.parametrize("num_threads", [1, 2])
def test_split_long_context(isa, num_threads):
    previous = torch.get_num_threads()
    ops.set_num_threads(num_threads)
    try:
        args = _packed(_inputs([1500], 16, 128, 64, 512, 128, 64, seed=3))
        separate = _with_cache_copy(args)
        got = ops.mla_decode_absorbed(**args)
        assert torch.equal(got, reference_mla.absorbed_chain(_mla_ops._SEPARATE_OPS, **separate))
    finally:
        ops.set_num_threads(previous)


def _refused(args: dict, match: str, error=ValueError) -> None:
    before = args["kv_cache"].clone()
    with pytest.raises(error, match=match):
        ops.mla_decode_absorbed(**args)
    assert torch.equal(args["kv_cache"], before)  # nothing stored


def test_checks_before_the_cache_is_written(isa):
    make = lambda: _packed(_inputs([10, 20], 4, 16, 8, 32, 16, 16))  # noqa: E731
    args = make()
    args["page_table"][1, 0] = args["kv_cache"].shape[0]  # past the last page
    _refused(args, "page_table")
    args = make()
    args["seq_lens"] = torch.tensor([10, 17 * 16], dtype=torch.int32)  # more than its pages
    _refused(args, "seq_lens")
    args = make()
    args["positions"] = torch.tensor([9, args["cos_sin"].shape[0]])  # past the cos/sin table
    _refused(args, "position", IndexError)
    args = make()
    args["kv_a"] = args["kv_a"][:, :-2]
    _refused(args, "kv_a")
    args = make()
    args["w_uv_t"] = ops.prepack_bmm(torch.zeros(4, 30, 16, dtype=torch.bfloat16))  # L != 32
    _refused(args, "W_UK and W_UV")


@pytest.mark.parametrize(
    "change",
    ["unpacked_weights", "float32", "strided_cache", "odd_q_stride"],
)
def test_uncovered_cases_run_the_chain(isa, change):
    """What the kernel does not take runs the separate ops, to the same result."""
    dtype = torch.float32 if change == "float32" else torch.bfloat16
    args = _inputs([9, 31], 2, 16, 8, 32, 16, 4, seed=5, dtype=dtype)
    if change != "unpacked_weights":
        args = _packed(args)
    if change == "strided_cache":
        args["kv_cache"] = _strided(args["kv_cache"])
    if change == "odd_q_stride":  # rows of 49 values: q_nope's pairs not 4-byte aligned
        padded = torch.zeros(2, 2 * 24 + 1, dtype=dtype)
        padded[:, :48] = args["q"].reshape(2, 48)
        args["q"] = padded.as_strided((2, 2, 24), (49, 24, 1))
    assert not _mla_ops._covered(
        *(args[k] for k in ("q", "kv_a", "kv_a_norm", "positions", "cos_sin", "w_uk", "w_uv_t")),
        args["kv_cache"],
    )
    separate = _with_cache_copy(args)
    got = ops.mla_decode_absorbed(**args)
    assert torch.equal(got, reference_mla.absorbed_chain(_mla_ops._SEPARATE_OPS, **separate))
