"""control.protocol.StepTokens: one decode step's output for all its requests in one message.
Round trips through the codec (with and without logprobs, several tokens per request, a request
with none), every malformed form is a ProtocolError (never another exception), the size bounds
hold, and `step_tokens_messages` splits only past them, keeping the order."""

import msgpack
import pytest

from control import protocol
from control.protocol import ProtocolError, RequestTokens, StepTokens, decode, encode

OUTPUTS = [
    RequestTokens("a", [5, 6, 7]),  # several tokens in one step (speculative decoding)
    RequestTokens("b", [], "stop"),  # P's first token already ended it
    RequestTokens("c", [9], "length"),
]
WITH_LOGPROBS = [
    RequestTokens("a", [5, 6], None, [-0.5, -1.0], [[5, 2], [6, 3]], [[-0.5, -2.0], [-1.0, -1.5]]),
    RequestTokens("b", [8]),  # did not ask
    RequestTokens("c", [9], "stop", [-0.25], [[9]], [[-0.25]]),
]


def frame(**fields) -> bytes:
    """A StepTokens frame with `fields` as given (bypassing the constructor's checks)."""
    body = {"request_ids": ["a"], "token_ids": [[1]], "finish_reasons": [None], **fields}
    return msgpack.packb({"type": "StepTokens", **body}, use_bin_type=True)


@pytest.mark.parametrize("outputs", [OUTPUTS, WITH_LOGPROBS, []], ids=["plain", "logprobs", "none"])
def test_round_trip_keeps_every_request_in_order(outputs):
    msg = StepTokens.of(outputs)
    back = decode(encode(msg))
    assert back == msg and back.outputs() == outputs


def test_columns_are_compact_without_logprobs():
    msg = StepTokens.of(OUTPUTS)
    assert msg.request_ids == ["a", "b", "c"] and msg.token_ids == [[5, 6, 7], [], [9]]
    assert msg.finish_reasons == [None, "stop", "length"]
    assert msg.logprobs == msg.top_ids == msg.top_logprobs == []  # nobody asked: no columns


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"token_ids": [[1], [2]]}, "differ in length"),
        ({"finish_reasons": []}, "differ in length"),
        ({"request_ids": ["a", "b"]}, "differ in length"),
        ({"logprobs": [[-1.0]], "top_ids": [], "top_logprobs": []}, "logprob columns"),
        (
            {
                "logprobs": [[-1.0], [-2.0]],
                "top_ids": [[[1]], [[2]]],
                "top_logprobs": [[[-1.0]], [[-2.0]]],
            },
            "logprob columns",
        ),
        (
            {
                "logprobs": [[-1.0, -2.0]],
                "top_ids": [[[1], [2]]],
                "top_logprobs": [[[-1.0], [-2.0]]],
            },
            "do not match its tokens",
        ),
        ({"logprobs": [[-1.0]], "top_ids": [[]], "top_logprobs": [[]]}, "do not match its tokens"),
        (
            {"logprobs": [[-1.0]], "top_ids": [[[1, 2]]], "top_logprobs": [[[-1.0]]]},
            "top_ids and top_logprobs",
        ),
        ({"token_ids": [["x"]]}, "wrong type"),
        ({"token_ids": [1]}, "wrong type"),
        ({"finish_reasons": [3]}, "wrong type"),
        ({"request_ids": [None]}, "wrong type"),
        ({"top_ids": [[[1.5]]], "logprobs": [[-1.0]], "top_logprobs": [[[-1.0]]]}, "wrong type"),
        ({"node": "d0"}, "unknown fields"),
    ],
)
def test_malformed_step_tokens_are_protocol_errors(fields, match):
    with pytest.raises(ProtocolError, match=match):
        decode(frame(**fields))


def test_a_missing_column_is_a_protocol_error():
    raw = msgpack.packb({"type": "StepTokens", "request_ids": [], "token_ids": []})
    with pytest.raises(ProtocolError, match="missing field 'finish_reasons'"):
        decode(raw)


def test_size_bounds_are_protocol_errors():
    num = protocol.MAX_STEP_REQUESTS + 1
    many = frame(request_ids=["r"] * num, token_ids=[[1]] * num, finish_reasons=[None] * num)
    with pytest.raises(ProtocolError, match="requests, more than"):
        decode(many)
    long = frame(token_ids=[[1] * (protocol.MAX_STEP_TOKENS + 1)])
    with pytest.raises(ProtocolError, match="tokens"):
        decode(long)


def test_messages_split_only_past_the_bounds_and_keep_the_order(monkeypatch):
    assert protocol.step_tokens_messages(OUTPUTS) == [StepTokens.of(OUTPUTS)]
    assert protocol.step_tokens_messages([]) == []
    monkeypatch.setattr(protocol, "MAX_STEP_REQUESTS", 2)
    outputs = [RequestTokens(f"r{i}", [i]) for i in range(5)]
    messages = protocol.step_tokens_messages(outputs)
    assert [len(m.request_ids) for m in messages] == [2, 2, 1]
    assert [out for m in messages for out in m.outputs()] == outputs
    monkeypatch.setattr(protocol, "MAX_STEP_REQUESTS", 100)
    monkeypatch.setattr(protocol, "MAX_STEP_TOKENS", 4)
    outputs = [RequestTokens("a", [1, 2, 3]), RequestTokens("b", [4, 5]), RequestTokens("c", [6])]
    messages = protocol.step_tokens_messages(outputs)
    assert [m.request_ids for m in messages] == [["a"], ["b", "c"]]
    assert all(decode(encode(m)) == m for m in messages)
