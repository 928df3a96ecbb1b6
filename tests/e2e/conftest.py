"""Fixtures shared by the e2e suites. Module-scoped: each module that uses `fp32_cluster` gets its
own cluster (started once for the module, stopped after it)."""

import pytest
from e2e_helpers import start_cluster

from control.tokenizer import Tokenizer
from tinymodel.make import ensure_tiny_model


@pytest.fixture(scope="module")
def fp32_cluster(tmp_path_factory):
    """`duet up`: 1P1D on the tiny model in float32, one thread per node (outputs compared
    with `duet generate --dtype float32`)."""
    args = ["--prefill", "1", "--decode", "1", "--dtype", "float32", "--threads", "1"]
    up = start_cluster(args, tmp_path_factory)
    yield up
    up.stop()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(ensure_tiny_model())
