"""The `make_link` fixture: every transfer test runs over both transports."""

import pytest
from kv_helpers import Link

from model.kv_pool import KVPool


@pytest.fixture(params=["inproc", "zmq"])
def make_link(request):
    """Factory: make_link(decode_pool) -> Link over the parametrized transport."""
    links: list[Link] = []

    def factory(decode_pool: KVPool) -> Link:
        links.append(Link(request.param, decode_pool))
        return links[-1]

    yield factory
    for link in links:
        link.close()
