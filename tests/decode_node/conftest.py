"""Node tests run with one kernel thread, like the nodes (fixtures in tests/conftest.py)."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def nodes_use_one_thread(one_thread):
    yield
