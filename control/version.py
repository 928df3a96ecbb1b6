"""The installed duet-serve version: what the router reports in `GET /v1/cluster` and every
node in its NodeReady, so a rolling upgrade shows which node runs what."""

from __future__ import annotations

import functools
from importlib import metadata


@functools.cache
def package_version() -> str:
    try:
        return metadata.version("duet-serve")
    except metadata.PackageNotFoundError:  # a source tree that was never `pip install`ed
        return "unknown"
