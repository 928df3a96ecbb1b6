"""control.finish.finish_reason: a stop token first, then the output length, then the context."""

from control.finish import finish_reason


def test_a_stop_token_ends_the_request_even_at_the_length_limit():
    assert finish_reason(7, {7}, 5, 50, max_new_tokens=5, max_positions=50) == "stop"


def test_the_output_length_and_the_context_end_it_on_the_token_that_reaches_them():
    assert finish_reason(1, {7}, 4, 20, max_new_tokens=5, max_positions=50) is None
    assert finish_reason(1, {7}, 5, 20, max_new_tokens=5, max_positions=50) == "length"
    assert finish_reason(1, {7}, 2, 49, max_new_tokens=5, max_positions=50) is None
    assert finish_reason(1, {7}, 2, 50, max_new_tokens=5, max_positions=50) == "length"
