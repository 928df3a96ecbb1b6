"""MTP speculative decoding (runtime.speculative, runtime.speculative_generate) against plain
decoding (OfflineGenerator), the oracle: greedy outputs identical token for token, sampled
outputs distributed identically, rejected drafts leave no row that is ever read."""

import dataclasses
import math

import pytest
import torch

import runtime.speculative_generate as speculative_generate
from control.errors import ConfigError
from control.sampling_params import SamplingParams
from model.deepseek import DeepseekModel
from runtime.generate import OfflineGenerator
from runtime.sampling import filter_probs
from runtime.speculative import accept_tokens, truncate_at_stop
from runtime.speculative_generate import SpeculativeGenerator
from tinymodel.make import make_tiny_model

PROMPTS = [
    [1, 5, 9, 30, 2, 7, 8, 100, 200, 3, 4, 17, 250],
    [7, 8, 9],
    list(range(40, 61)),
]


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("mtp"), seed=11, overrides={"num_nextn_predict_layers": 1}
    )


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def mtp_model(request, mtp_dir):
    return DeepseekModel.from_pretrained(
        mtp_dir, dtype=getattr(torch, request.param), progress=False, mtp=True
    )


def greedy(max_new=24, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True, **kw)


def test_loading_without_an_mtp_layer_is_refused(tiny_dir):
    with pytest.raises(ConfigError, match="MTP layer"):
        DeepseekModel.from_pretrained(tiny_dir, dtype=torch.bfloat16, progress=False, mtp=True)


def test_mtp_model_without_mtp_decodes_as_before(mtp_dir, mtp_model):
    """Loading the MTP layer changes nothing of the main model's output."""
    plain = DeepseekModel.from_pretrained(mtp_dir, dtype=mtp_model.dtype, progress=False)
    for prompt in PROMPTS:
        a = OfflineGenerator(plain, page_size=4).generate(prompt, greedy()).token_ids
        b = OfflineGenerator(mtp_model, page_size=4).generate(prompt, greedy()).token_ids
        assert a == b


@pytest.mark.parametrize("num_draft", [1, 2, 3])
def test_greedy_output_is_identical_with_mtp(mtp_model, num_draft):
    plain = OfflineGenerator(mtp_model, page_size=4, chunk_size=5)
    spec = SpeculativeGenerator(mtp_model, num_draft, page_size=4, chunk_size=5)
    for prompt in PROMPTS:
        expected = plain.generate(prompt, greedy()).token_ids
        assert spec.generate(prompt, greedy()).token_ids == expected
    assert spec.num_drafted > 0 and spec.num_steps > 0


def _oracle_drafts(monkeypatch, continuation_of, wrong_every=0):
    """Replaces the MTP layer's drafts (the prefill's too) with the plain output's next tokens
    (the real MTP passes still run and write their rows), every `wrong_every`-th draft made
    wrong on purpose."""
    real = speculative_generate.draft
    calls = [0]

    def fake(model, pool, tables, tokens, positions, hidden, num_drafts):
        real(model, pool, tables, tokens, positions, hidden, num_drafts)
        out = []
        for toks, pos, n in zip(tokens, positions, num_drafts, strict=True):
            truth = continuation_of(pos + len(toks) + 1, n)
            calls[0] += 1
            if wrong_every and calls[0] % wrong_every == 0 and truth:
                truth[-1] = (truth[-1] + 1) % model.cfg.vocab_size
            out.append(truth)
        return out

    real_prefill = speculative_generate.prefill_with_draft

    def prefill(model, pool, table, prompt_ids, chunk_size, first_token_of):
        token, _ = real_prefill(model, pool, table, prompt_ids, chunk_size, first_token_of)
        return token, continuation_of(len(prompt_ids) + 1, 1)[0]

    monkeypatch.setattr(speculative_generate, "draft", fake)
    monkeypatch.setattr(speculative_generate, "prefill_with_draft", prefill)


@pytest.mark.parametrize("num_draft,wrong_every", [(1, 0), (3, 0), (3, 2), (4, 3)])
def test_accepted_drafts_across_page_boundaries_keep_the_output(
    mtp_model, monkeypatch, num_draft, wrong_every
):
    """Drafts that are right emit several tokens a step (their rows cross page boundaries:
    page_size 3), drafts that are wrong are rolled back: the output stays the plain one."""
    prompt, params = PROMPTS[0], greedy(max_new=30)
    expected = OfflineGenerator(mtp_model, page_size=3).generate(prompt, params).token_ids
    full = prompt + expected

    _oracle_drafts(monkeypatch, lambda pos, n: full[pos : pos + n], wrong_every)
    spec = SpeculativeGenerator(mtp_model, num_draft, page_size=3, chunk_size=4)
    assert spec.generate(prompt, params).token_ids == expected
    if wrong_every == 0:
        assert spec.acceptance_rate == 1.0
        assert spec.num_steps <= math.ceil((len(expected) - 1) / (num_draft + 1)) + 1
    else:
        assert 0.0 < spec.acceptance_rate < 1.0


def test_rejected_rows_are_rewritten_before_anyone_reads_them(mtp_model, monkeypatch):
    """After a generation whose every draft is wrong, the main layers' cache rows of the
    output equal those plain decoding writes: no stale draft row is left in the sequence."""
    prompt, params = PROMPTS[1], greedy(max_new=12)
    plain = OfflineGenerator(mtp_model, page_size=4)
    expected = plain.generate(prompt, params).token_ids
    full = prompt + expected
    wrong = lambda pos, n: [(t + 1) % 64 for t in full[pos : pos + n]]  # noqa: E731
    _oracle_drafts(monkeypatch, wrong)
    spec = SpeculativeGenerator(mtp_model, 2, page_size=4)
    rows = {}
    for name, gen in (("plain", plain), ("spec", spec)):
        release = gen.pool.release
        gen.pool.release = lambda table, g=gen, n=name, release=release: (
            rows.__setitem__(
                n,
                g.pool.read_rows(table, 0, mtp_model.cfg.num_hidden_layers, 0, len(full) - 1),
            ),
            release(table),
        )
        assert gen.generate(prompt, params).token_ids == expected
    assert spec.num_accepted == 0 and spec.num_drafted > 0
    # bf16 rows are bit-identical; fp32 GEMMs round differently with 3 rows than with 1
    # (~1e-6), while a stale row (another token's) would differ by the rows' own scale, ~1.
    atol = 0.0 if mtp_model.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(rows["spec"], rows["plain"], rtol=0, atol=atol)
    assert rows["plain"].abs().amax() > 0.1


def test_stop_token_inside_accepted_drafts_ends_there(mtp_model, monkeypatch):
    prompt = PROMPTS[2]
    expected = OfflineGenerator(mtp_model).generate(prompt, greedy(max_new=20)).token_ids
    stop = expected[7]
    first = expected.index(stop)
    full = prompt + expected
    _oracle_drafts(monkeypatch, lambda pos, n: full[pos : pos + n])
    spec = SpeculativeGenerator(mtp_model, 4, page_size=4)
    params = greedy(max_new=20, stop_token_ids=(stop,))
    result = spec.generate(prompt, params)
    assert result.token_ids == expected[: first + 1] and result.finish_reason == "stop"
    result = spec.generate(prompt, greedy(max_new=6))
    assert result.token_ids == expected[:6] and result.finish_reason == "length"


def test_truncate_at_stop():
    assert truncate_at_stop([4, 5, 6], frozenset({5}), 10) == ([4, 5], True)
    assert truncate_at_stop([4, 5, 6], frozenset(), 2) == ([4, 5], False)
    assert truncate_at_stop([4, 5, 6], frozenset({6}), 2) == ([4, 5], False)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("top_k", [-1, 4])
def test_rejection_sampling_emits_the_target_distribution(top_k):
    """accept_tokens over many seeds: the first emitted token is distributed as the target's
    first row, and, given it equals the draft, the second as the second row (lossless)."""
    vocab, draws = 6, 4000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen) * 1.5
    drafts = [int(logits[0].argmax()), int(logits[1].argsort()[-2])]
    params = SamplingParams(temperature=0.8, top_k=top_k, max_new_tokens=8)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for seed in range(draws):
        out = accept_tokens(logits, drafts, params, seed, 5)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    target = filter_probs(logits, [params] * 3)
    target = target / target.sum(-1, keepdim=True)
    # chi-square with vocab - 1 = 5 degrees of freedom: 20.5 is its 0.999 quantile.
    assert _chi_square(first, target[0]) < 20.5
    assert _chi_square(second, target[1]) < 20.5


def test_greedy_acceptance_takes_drafts_up_to_the_first_miss():
    logits = torch.full((4, 5), -1.0)
    for row, token in enumerate([2, 3, 1, 4]):
        logits[row, token] = 1.0
    params = greedy()
    assert accept_tokens(logits, [2, 3, 1], params, None, 0) == [2, 3, 1, 4]
    assert accept_tokens(logits, [2, 0, 1], params, None, 0) == [2, 3]
    assert accept_tokens(logits, [0, 3, 1], params, None, 0) == [2]
    with pytest.raises(ValueError):
        accept_tokens(logits, [2], params, None, 0)


def test_sampled_generation_with_mtp_matches_plain_decoding_in_distribution(mtp_model, monkeypatch):
    """End to end, temperature 1 and top_k 3 so each position has few outcomes: over many
    seeds, the second and third output tokens with MTP follow the same law as without. The
    drafts are the plain model's most likely next tokens (so both the accept and the reject
    paths run often); the exact oracle is the plain model's conditional law, computed once
    per prefix with a prefill."""
    if mtp_model.dtype != torch.float32:
        pytest.skip("one dtype is enough for the statistics")
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=3.0, top_k=3, max_new_tokens=3, ignore_eos=True)
    plain = OfflineGenerator(mtp_model, page_size=4)
    law: dict[tuple, torch.Tensor] = {}

    def probs_after(prefix: tuple) -> torch.Tensor:
        if prefix not in law:
            table = plain.pool.new_table()
            logits = plain.prefill(table, list(prefix))[None]
            plain.pool.release(table)
            p = filter_probs(logits, [params])[0]
            law[prefix] = p / p.sum()
        return law[prefix]

    output: list[int] = []  # the running generation's tokens so far
    real_prefill, real_truncate = (
        speculative_generate.prefill_with_draft,
        speculative_generate.truncate_at_stop,
    )

    def prefill(*args):
        token, _ = real_prefill(*args)
        output[:] = [token]
        return token, int(probs_after(tuple(prompt + output)).argmax())

    def truncate(emitted, stop_ids, room):
        kept, stopped = real_truncate(emitted, stop_ids, room)
        output.extend(kept)
        return kept, stopped

    def likely_drafts(model, pool, tables, tokens, positions, hidden, num_drafts):
        drafts = []
        for _ in range(num_drafts[0]):
            drafts.append(int(probs_after(tuple(prompt + output + drafts)).argmax()))
        return [drafts]

    monkeypatch.setattr(speculative_generate, "prefill_with_draft", prefill)
    monkeypatch.setattr(speculative_generate, "truncate_at_stop", truncate)
    monkeypatch.setattr(speculative_generate, "draft", likely_drafts)
    spec = SpeculativeGenerator(mtp_model, 2, page_size=4)
    counts: dict[tuple, torch.Tensor] = {}
    for seed in range(300):
        out = spec.generate(prompt, dataclasses.replace(params, seed=seed)).token_ids
        for n in (1, 2):
            c = counts.setdefault(tuple(prompt + out[:n]), torch.zeros(mtp_model.cfg.vocab_size))
            c[out[n]] += 1
    assert spec.num_accepted > 50 and spec.num_drafted - spec.num_accepted > 50
    stat, dof = 0.0, 0
    for prefix, c in counts.items():
        if c.sum() >= 30:
            stat += _chi_square(c, probs_after(prefix))
            dof += int((probs_after(prefix) > 0).sum()) - 1
    assert dof >= 6
    # Wilson-Hilferty 0.999 quantile of chi-square(dof): z = 3.09.
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert stat < limit


def test_mtp_rows_that_only_fill_the_cache_stop_after_attention(mtp_model):
    """forward_mtp with `logit_rows` (a draft pass: only each request's last row continues past
    attention) gives those rows' logits and hidden states as the full layer does, and writes
    the same KV rows."""
    from runtime.speculative import rows_batch

    if mtp_model.dtype != torch.float32:
        pytest.skip("fp32: the MoE over fewer rows rounds alike only there")
    outs = []
    for keep in (False, True):
        pool = mtp_model.new_kv_pool(num_pages=16, page_size=4)
        tables = [pool.new_table(), pool.new_table()]
        for table in tables:
            pool.reserve(table, 12)
        gen = torch.Generator().manual_seed(0)
        batch = rows_batch(pool, tables, [[5, 6, 7], [9, 10]], [4, 8])
        hidden = torch.randn(5, mtp_model.cfg.hidden_size, generator=gen)
        rows = torch.tensor([2, 4]) if keep else None
        logits, out = mtp_model.forward_mtp(batch, hidden, pool, logit_rows=rows)
        if not keep:
            logits, out = logits[[2, 4]], out[[2, 4]]
        layer = pool.layer(mtp_model.cfg.num_hidden_layers)
        kv = layer.reshape(-1, layer.shape[-1])[batch.slots]  # the rows this pass wrote
        outs.append((logits, out, kv))
    for a, b in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
