"""Fixtures shared by the router suites: the tiny model's directory and its tokenizer (the
oracle for expected text)."""

import pytest

from control.tokenizer import Tokenizer
from tinymodel.make import ensure_tiny_model


@pytest.fixture(scope="module")
def model_dir():
    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)
