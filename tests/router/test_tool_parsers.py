"""router.tool_parsers against hand-written model outputs: whole, streamed in every two- and
three-way split (whole calls, and arguments in pieces), malformed, text mixed with calls,
several calls; and router.tools' grammar: what it accepts is exactly what the parser reads back
as calls of the right functions."""

import itertools
import json

import llguidance as llg
import pytest

from control.structured_output import GrammarChecker
from router.chat_output import ChatOutput, join_calls
from router.tool_parsers import (
    ToolCall,
    ToolCallDelta,
    ToolCallSplitter,
    join_deltas,
    parse_tool_calls,
)
from router.tools import Tool, ToolChoice, call_grammar

WEATHER = ToolCall("get_weather", '{"city": "Paris"}')
TIME = ToolCall("get_time", '{"zone": "CET", "24h": true}')


def hermes(call: ToolCall) -> str:
    return f'<tool_call>\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n</tool_call>'


def deepseek(*calls: ToolCall) -> str:
    body = "".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{c.name}\n```json\n{c.arguments}\n```"
        "<｜tool▁call▁end｜>"
        for c in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


CASES = {
    "hermes": [
        (hermes(WEATHER), "", [WEATHER]),
        (
            "Let me check. " + hermes(WEATHER) + "\n" + hermes(TIME),
            "Let me check. \n",
            [WEATHER, TIME],
        ),
        ("no call at all, < tool_call > either", "no call at all, < tool_call > either", []),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),  # kept
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),
        ('cut short <tool_call>{"name": ', 'cut short <tool_call>{"name": ', []),
        (
            '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
            "",
            [ToolCall("f", '{"a": 1}')],
        ),
    ],
    "deepseek_v3": [
        (deepseek(WEATHER), "", [WEATHER]),
        ("Sure." + deepseek(WEATHER, TIME), "Sure.", [WEATHER, TIME]),
        (deepseek(ToolCall("f", "[1]")), deepseek(ToolCall("f", "[1]")), []),  # not an object
        ("plain text", "plain text", []),
    ],
}
ALL = [(parser, *case) for parser, cases in CASES.items() for case in cases]


def normalized(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL)
def test_a_whole_output(parser, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, parser)
    assert got_content == content
    assert normalized(got_calls) == normalized(calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL)
def test_streamed_in_any_split_gives_the_same(parser, text, content, calls):
    cuts = range(len(text) + 1)
    for points in itertools.chain(itertools.combinations(cuts, 1), itertools.combinations(cuts, 2)):
        bounds = [0, *points, len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        splitter = ToolCallSplitter(parser)
        parts = [splitter.push(p, is_last=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(c for c, _ in parts) == content, pieces
        assert normalized([call for _, found in parts for call in found]) == normalized(calls)


def splits(text):
    """Every way to cut `text` in two or three pieces."""
    cuts = range(len(text) + 1)
    for points in itertools.chain(itertools.combinations(cuts, 1), itertools.combinations(cuts, 2)):
        bounds = [0, *points, len(text)]
        yield [text[a:b] for a, b in itertools.pairwise(bounds)]


def streamed(parser, pieces):
    splitter = ToolCallSplitter(parser, stream_arguments=True)
    parts = [splitter.push(p, is_last=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return "".join(c for c, _ in parts), [d for _, found in parts for d in found]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL)
def test_whole_calls_carry_the_arguments_as_the_model_wrote_them(parser, text, content, calls):
    _, got = parse_tool_calls(text, parser)
    assert got == calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL)
def test_arguments_streamed_in_pieces_join_to_the_whole_calls(parser, text, content, calls):
    for pieces in splits(text):
        got_content, deltas = streamed(parser, pieces)
        assert got_content == content, pieces
        assert join_deltas(deltas) == calls, pieces
        for delta in deltas:  # a call's name comes on its first piece, and only there
            first = next(d for d in deltas if d.index == delta.index)
            assert (delta.name is not None) == (delta is first)


def test_a_whole_call_is_handed_out_once_its_block_closes():
    splitter = ToolCallSplitter("hermes")
    text = hermes(WEATHER)
    middle = len(text) // 2
    assert splitter.push("Hi " + text[:middle]) == ("Hi ", [])
    content, calls = splitter.push(text[middle:])
    assert content == "" and calls == [ToolCallDelta(0, WEATHER.name, WEATHER.arguments)]


def test_a_streamed_call_is_announced_by_name_then_its_arguments_follow():
    splitter = ToolCallSplitter("deepseek_v3", stream_arguments=True)
    text = deepseek(WEATHER, TIME)
    header = text.index("{")  # the first call's arguments start here
    announced = [ToolCallDelta(0, "get_weather", ""), ToolCallDelta(0, None, '{"c')]
    assert splitter.push(text[: header + 3]) == ("", announced)
    rest = text[header + 3 :]
    second = rest.index("{")
    content, deltas = splitter.push(rest[: second + 1])
    assert content == ""
    assert deltas == [
        ToolCallDelta(0, None, 'ity": "Paris"}'),
        ToolCallDelta(1, "get_time", ""),
        ToolCallDelta(1, None, "{"),
    ]
    content, deltas = splitter.push(rest[second + 1 :], is_last=True)
    assert content == "" and deltas == [ToolCallDelta(1, None, TIME.arguments[1:])]


def test_a_malformed_block_after_an_announced_call_keeps_the_call_and_its_text():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1} oops</tool_call> after'
    # whole: the block does not parse, so it is content, as the model wrote it
    assert parse_tool_calls(text, "hermes") == (text, [])
    # streamed: the call went out before the block turned out malformed; the rest is content
    content, deltas = streamed("hermes", [text[:45], text[45:]])
    assert join_deltas(deltas) == [ToolCall("f", '{"a": 1}')]
    assert content == " oops after"


def test_a_streamed_call_cut_off_at_the_end_stays_as_it_went_out():
    text = '<tool_call>{"name": "f", "arguments": {"a": [1, 2'
    assert parse_tool_calls(text, "hermes") == (text, [])  # whole: never closed, so content
    content, deltas = streamed("hermes", [text[:40], text[40:]])
    assert content == "" and join_deltas(deltas) == [ToolCall("f", '{"a": [1, 2')]


def test_braces_and_quotes_inside_strings_do_not_end_the_arguments():
    call = ToolCall("say", '{"text": "a } \\" ] { b", "n": {"m": [1]}}')
    for pieces in splits(hermes(call)):
        assert join_deltas(streamed("hermes", pieces)[1]) == [call], pieces


TOOLS = [
    Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}, {}),
    Tool("get_time", {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}},
                      "required": ["zone"]}, {}),
]  # fmt: skip


@pytest.fixture(scope="module")
def llg_tokenizer(model_dir):
    return GrammarChecker(model_dir, 2112, []).tokenizer


def accepts(tokenizer, lark: str, text: str) -> bool:
    matcher = llg.LLMatcher(tokenizer, llg.LLMatcher.grammar_from_lark(lark))
    ok = matcher.consume_tokens(tokenizer.tokenize_str(text))
    return ok and matcher.is_accepting()


@pytest.mark.parametrize("parser", ["hermes", "deepseek_v3"])
def test_the_forced_call_grammar_accepts_exactly_valid_calls(parser, llg_tokenizer):
    write = hermes if parser == "hermes" else deepseek
    weather, bad = (
        ToolCall("get_weather", '{"city": "Paris"}'),
        ToolCall("get_weather", '{"town": 1}'),
    )
    named = call_grammar(parser, TOOLS, ToolChoice("named", "get_weather"), parallel=True)
    assert accepts(llg_tokenizer, named, write(weather))
    assert not accepts(llg_tokenizer, named, write(bad))  # the schema's required key
    assert not accepts(llg_tokenizer, named, write(ToolCall("get_time", '{"zone": "CET"}')))
    required = call_grammar(parser, TOOLS, ToolChoice("required"), parallel=True)
    assert accepts(llg_tokenizer, required, write(ToolCall("get_time", '{"zone": "UTC"}')))
    assert not accepts(llg_tokenizer, required, "just text")
    # what the grammar accepts, the parser reads back
    assert normalized(parse_tool_calls(write(weather), parser)[1]) == normalized([weather])


def test_the_chat_delta_names_each_call_once_with_its_pieces_joined():
    output = ChatOutput(tool_parser="deepseek_v3", stream=True)
    text = deepseek(WEATHER)
    first = output.push(text[: text.index("{") + 3], 3, is_last=False)
    (call,) = first["tool_calls"]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"c'}
    rest = output.push(text[text.index("{") + 3 :], 5, is_last=True)
    assert rest == {"tool_calls": [{"index": 0, "function": {"arguments": 'ity": "Paris"}'}}]}
    whole = {"name": WEATHER.name, "arguments": WEATHER.arguments}
    expected = [{"id": call["id"], "type": "function", "function": whole}]
    assert join_calls(first["tool_calls"] + rest["tool_calls"]) == expected
    assert output.finish_reason("stop") == "tool_calls"
