"""runtime.grammar: specs compile or fail with a clear reason, batched masks equal the
library's own single-matcher bitmask, the apply equals a plain loop, forks are independent, and
constrained offline generation always yields a valid output (json.loads + jsonschema)."""

import json

import pytest
import torch
from structured_cases import CASES, JSON_OBJECT, MAX_NEW, OBJECT_SCHEMA, check_output

from control.errors import InvalidRequestError
from control.model_config import ModelConfig
from control.protocol import sampling_from_dict, sampling_to_dict
from control.sampling_params import SamplingParams
from control.structured_output import MAX_SPEC_CHARS, StructuredOutput
from control.tokenizer import Tokenizer
from runtime.generate import OfflineGenerator
from runtime.grammar import MIN_OVERLAP_ROWS, Grammars, apply_masks, bitmask_bias

PADDED_VOCAB = 600  # the tiny tokenizer has 512 tokens: a model vocabulary padded past it


@pytest.fixture(scope="module")
def cfg(tiny_dir):
    return ModelConfig.from_model_dir(tiny_dir)


@pytest.fixture(scope="module")
def grammars(tiny_dir, cfg):
    g = Grammars(tiny_dir, PADDED_VOCAB, cfg.eos_token_id)
    yield g
    g.close()


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer(tiny_dir)


def allowed_by_library(matcher) -> set[int]:
    """The oracle: the tokens set in the library's own single-matcher bitmask, bit by bit."""
    words = matcher.bitmask().tolist()
    return {t for t in range(len(words) * 32) if (words[t // 32] >> (t % 32)) & 1}


def walk(grammars, tok, kind, spec, text):
    """A matcher after each token of `text` (the tokenizer's own ids), the start one first."""
    m = grammars.matcher((kind, spec))
    states = [m.fork()]
    for token in tok.encode(text):
        assert m.consume(token), m.error
        states.append(m.fork())
    return states


# ---- compile and validate ------------------------------------------------------------------
@pytest.mark.parametrize("structured", [*CASES.values(), JSON_OBJECT])
def test_every_case_compiles(grammars, structured):
    grammars.check(structured)
    assert not grammars.matcher(structured).is_finished


@pytest.mark.parametrize(
    "structured,reason",
    [
        (("json_schema", "{not json"), "invalid json_schema: not valid JSON"),
        (("json_schema", "[1, 2]"), "a JSON schema must be an object"),
        (("json_schema", json.dumps({"type": "foo"})), "Invalid type: foo"),
        (("json_schema", json.dumps({"$ref": "#/nope"})), "/nope"),
        (("json_schema", json.dumps({"type": "string", "pattern": "[a-"})), "regex parse error"),
        (("json_schema", json.dumps({"type": "string", "minLength": "x"})), "minLength"),
        (("regex", "[a-"), "invalid regex: "),
        (("regex", "(ab"), "invalid regex: "),
        (("choice", "[]"), "1 to 1024 strings"),
        (("choice", '["a", 3]'), "a list of non-empty strings"),
        (("choice", '"a"'), "a list of non-empty strings"),
        (("grammar", "start: foo"), "invalid grammar: "),
    ],
)
def test_bad_specs_raise_a_clear_error(grammars, structured, reason):
    with pytest.raises(InvalidRequestError, match="structured output: ") as exc:
        grammars.check(structured)
    assert reason in str(exc.value) and "<state>" not in str(exc.value)
    with pytest.raises(InvalidRequestError):
        grammars.matcher(structured)


def test_kind_and_size_are_checked_before_compiling():
    with pytest.raises(InvalidRequestError, match="unknown kind 'yaml'"):
        StructuredOutput("yaml", "")
    for kind in ("json_schema", "regex"):
        limit = MAX_SPEC_CHARS[kind]
        StructuredOutput(kind, "x" * limit)
        with pytest.raises(InvalidRequestError, match=f"at most {limit} are accepted"):
            StructuredOutput(kind, "x" * (limit + 1))


def test_no_tokenizer_means_no_structured_output(tmp_path):
    g = Grammars(tmp_path, 512, [1])
    with pytest.raises(InvalidRequestError, match="no tokenizer.json"):
        g.matcher(("regex", "a"))


def test_sampling_params_carry_the_spec_over_the_wire():
    params = SamplingParams(structured=("json_schema", json.dumps(OBJECT_SCHEMA)))
    assert sampling_from_dict(sampling_to_dict(params)) == params
    assert sampling_from_dict(sampling_to_dict(SamplingParams())).structured is None
    with pytest.raises(InvalidRequestError, match="unknown kind"):
        SamplingParams(structured=("yaml", ""))
    with pytest.raises(InvalidRequestError, match="structured must be \\(kind, spec\\)"):
        SamplingParams(structured=("regex", 3))
    after = SamplingParams(structured=("regex", "a+", "</think>"))
    assert sampling_from_dict(sampling_to_dict(after)) == after
    with pytest.raises(InvalidRequestError, match="structured must be"):
        SamplingParams(structured=("regex", "a+", "</think>", "x"))
    with pytest.raises(InvalidRequestError, match="at most 64 characters"):
        SamplingParams(structured=("regex", "a+", "x" * 65))
    with pytest.raises(InvalidRequestError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured=("regex", "a+"))


def test_structured_resume_names_the_output_to_replay():
    params = SamplingParams(structured=("regex", "a+"), structured_resume=2)
    assert params.uses_prompt and params.resumed_output([7, 8, 9]) == [8, 9]
    assert SamplingParams(structured=("regex", "a+")).resumed_output([7, 8]) == []
    assert sampling_from_dict(sampling_to_dict(params)) == params
    with pytest.raises(InvalidRequestError, match="exceeds the prompt's 1 tokens"):
        params.resumed_output([7])
    for bad in (dict(structured_resume=1), dict(structured=("regex", "a"), structured_resume=-1)):
        with pytest.raises(InvalidRequestError, match="structured_resume must be >= 0"):
            SamplingParams(**bad)


def test_a_structured_request_always_stops_at_eos():
    """ignore_eos cannot make a complete grammar run on: EOS stays a stop token."""
    assert SamplingParams(ignore_eos=True).stop_ids([1]) == frozenset()
    assert SamplingParams(ignore_eos=True, structured=("regex", "a")).stop_ids([1]) == {1}


# ---- after the reasoning -------------------------------------------------------------------
THINKING = 'Let me see: {"a": maybe} or "b" </thi nk> '  # free text no body below accepts


@pytest.mark.parametrize("name", ["object", "regex", "choice"])
def test_a_grammar_after_the_reasoning_leaves_the_thinking_free(grammars, tok, name):
    """(kind, spec, "</think>"): the text before the first "</think>" is free (here a text the
    spec itself refuses at once), the output cannot end there, and after the tag the allowed
    tokens are exactly the spec's own at its start (the oracle: the spec's matcher alone)."""
    kind, spec = CASES[name]
    alone = grammars.matcher((kind, spec))
    assert not all(alone.fork().consume(t) for t in tok.encode(THINKING))
    after = grammars.matcher((kind, spec, "</think>"))
    for token in tok.encode(THINKING):
        assert after.consume(token), after.error
    assert not after.is_accepting
    for token in tok.encode("</think>"):
        assert after.consume(token), after.error
    assert allowed_by_library(after) == allowed_by_library(alone)
    (token, *_) = tok.encode("</think>")  # a second closing tag is the spec's to allow, not free
    assert (token in allowed_by_library(after)) == (token in allowed_by_library(alone))


@pytest.mark.parametrize(
    "grammar", ["{}", '{"grammars": 3}', '{"grammars": [{"lark_grammar": "start: \\"a\\""}]}']
)
def test_a_grammar_after_the_reasoning_reads_any_grammar_text(grammars, grammar):
    """Whatever a request's grammar text is (llguidance's JSON form, or text that only looks like
    it), wrapping it never fails on its own: it compiles, or fails with the library's reason."""
    try:
        grammars.check(("grammar", grammar, "</think>"))
    except InvalidRequestError as exc:
        assert "invalid grammar" in str(exc)
    else:
        assert grammar.startswith('{"grammars": [')


# ---- masks -----------------------------------------------------------------------------------
def test_batched_masks_equal_the_library_bitmask(grammars, tok):
    """Rows at different places of different grammars (and rows without one): each row's
    allowed set is the library's single-matcher one; the padded ids past the tokenizer and the
    unconstrained rows stay allowed only where they should."""
    states = walk(grammars, tok, *CASES["object"], '{"color": "red", "count": 42, "ok": true}')
    states += walk(grammars, tok, *CASES["regex"], "abc-12")
    states += walk(grammars, tok, *CASES["choice"], "maybe so")
    batch = [None, *states[::3], None, *states[-4:]]
    masks = grammars.compute_masks(batch)
    assert masks.rows == [i for i, m in enumerate(batch) if m is not None]
    assert masks.bias.shape == (len(masks.rows), PADDED_VOCAB)
    for k, row in enumerate(masks.rows):
        ours = set((masks.bias[k] == 0).nonzero().flatten().tolist())
        assert ours == allowed_by_library(batch[row])
        assert ours and max(ours) < 512  # never a token the tokenizer lacks
        assert torch.isneginf(masks.bias[k][masks.bias[k] != 0]).all()


def test_a_complete_grammar_allows_only_eos(grammars, tok, cfg):
    (eos,) = cfg.eos_token_id
    for name, text in (("choice", "maybe so"), ("regex", "abcdef-123"), ("object", None)):
        text = text or '{"color": "blue", "count": 7, "ok": false}'
        done = walk(grammars, tok, *CASES[name], text)[-1]
        assert done.is_finished and done.is_accepting
        assert allowed_by_library(done) == {eos}
        assert done.consume(eos) and not done.error
    partial = walk(grammars, tok, *CASES["regex"], "ab-1")[-1]  # complete, could go on
    assert not partial.is_finished and partial.is_accepting
    assert eos in allowed_by_library(partial) and len(allowed_by_library(partial)) > 1


def test_apply_masks_equals_a_plain_loop(grammars, tok):
    states = walk(grammars, tok, *CASES["array"], '{"xs": [1, 2], "tag": "a"}')
    batch = [states[0], None, states[5], states[-1], None]
    logits = torch.randn(len(batch), PADDED_VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = apply_masks(logits, batch, grammars.executor)
    assert torch.equal(logits, before)  # the model's logits stay as they were (logprobs)
    for i, m in enumerate(batch):
        allowed = allowed_by_library(m) if m is not None else set(range(PADDED_VOCAB))
        for t in range(PADDED_VOCAB):
            want = logits[i, t].item() if t in allowed else float("-inf")
            assert out[i, t].item() == want
    assert apply_masks(logits, [None] * len(batch)) is logits


def test_masks_of_a_subset_of_the_batch_apply_as_the_whole_ones_do(grammars, tok):
    """`select`: the rows still wanted after some left the batch (the overlapped step)."""
    states = walk(grammars, tok, *CASES["array"], '{"xs": [1, 2], "tag": "a"}')
    batch = [states[0], None, states[5], None, states[-1]]
    masks = grammars.compute_masks(batch)
    logits = torch.randn(len(batch), PADDED_VOCAB, generator=torch.Generator().manual_seed(1))
    whole = masks.apply(logits)
    for keep in ([0, 1, 2, 3, 4], [4, 1, 0], [1, 3], [2]):
        picked = masks.select(keep)
        if all(batch[i] is None for i in keep):
            assert picked is None
        else:
            assert torch.equal(picked.apply(logits[keep]), whole[keep]), keep


def test_bitmask_bias_reads_bits_little_endian():
    bitmask = torch.tensor([[0b101, -(2**31)], [-1, 1]], dtype=torch.int32)
    bias = bitmask_bias(bitmask, 64)
    assert (bias[0] == 0).nonzero().flatten().tolist() == [0, 2, 63]
    assert (bias[1] == 0).nonzero().flatten().tolist() == [*range(32), 32]


def test_masks_on_the_helper_thread_equal_the_inline_ones(grammars, tok):
    states = walk(grammars, tok, *CASES["string"], '{"name": "bob"}')
    assert len(states) >= MIN_OVERLAP_ROWS  # enough rows to go to the thread
    for batch in (states, [None, *states[:2]]):  # on the thread; at once (too few rows)
        inline = grammars.compute_masks(batch)
        started = grammars.start_masks(batch).result(timeout=30)
        assert started.rows == inline.rows and torch.equal(started.bias, inline.bias)
    assert grammars.start_masks([None, None]).result(timeout=1) is None


def test_forks_are_independent(grammars, tok):
    parent = grammars.matcher(CASES["choice"])
    start = allowed_by_library(parent)
    yes, no = parent.fork(), parent.fork()
    for child, text in ((yes, "yes"), (no, "no")):
        for token in tok.encode(text):
            assert child.consume(token)
    assert yes.is_finished and no.is_finished
    assert allowed_by_library(parent) == start and not parent.is_finished
    (y,) = tok.encode("y")
    assert not no.consume(y) and no.error
    assert not yes.error  # the sibling's failure is its own


def test_a_refused_token_is_an_error(grammars, tok):
    m = grammars.matcher(CASES["object"])
    (token,) = tok.encode("x")
    assert not m.consume(token) and m.error and "<state>" not in m.error


# ---- offline generation ----------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.5, "seed": 5}])
@pytest.mark.parametrize("name", CASES)
def test_offline_outputs_are_valid(model, tok, name, sampling):
    generator = OfflineGenerator(model, page_size=16, chunk_size=256)
    kind, spec = CASES[name]
    params = SamplingParams(max_new_tokens=MAX_NEW, structured=(kind, spec), **sampling)
    result = generator.generate(tok.encode_prompt("The quick brown fox"), params)
    assert result.finish_reason == "stop" and result.token_ids[-1] in model.cfg.eos_token_id
    check_output(kind, spec, tok.decode(result.token_ids))


def test_offline_json_object(model, tok):
    """Any object: unbounded, so the prompt is one this model closes (`{}`); the text is
    checked all the same."""
    generator = OfflineGenerator(model, page_size=16, chunk_size=256)
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, structured=JSON_OBJECT)
    result = generator.generate(tok.encode_prompt("Once upon a time"), params)
    assert result.finish_reason == "stop"
    check_output(*JSON_OBJECT, tok.decode(result.token_ids))


def test_offline_structured_output_with_ignore_eos_still_stops(model, tok):
    generator = OfflineGenerator(model, page_size=16, chunk_size=256)
    params = SamplingParams(
        temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True, structured=CASES["choice"]
    )
    result = generator.generate(tok.encode_prompt("Hello"), params)
    assert result.finish_reason == "stop"
    check_output(*CASES["choice"], tok.decode(result.token_ids))
