"""router.tool_parsers against hand-written model outputs: whole, streamed in every two- and
three-way split, malformed, text mixed with calls, several calls; and router.tools' grammar:
what it accepts is exactly what the parser reads back as calls of the right functions."""

import itertools
import json

import llguidance as llg
import pytest

from control.structured_output import GrammarChecker
from router.tool_parsers import ToolCall, ToolCallSplitter, parse_tool_calls
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


def test_a_call_is_handed_out_once_its_block_closes():
    splitter = ToolCallSplitter("hermes")
    text = hermes(WEATHER)
    middle = len(text) // 2
    assert splitter.push("Hi " + text[:middle]) == ("Hi ", [])
    content, calls = splitter.push(text[middle:])
    assert content == "" and normalized(calls) == normalized([WEATHER])


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
