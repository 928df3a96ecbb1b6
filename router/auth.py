"""API keys of the HTTP gateway and the per-key count of unfinished requests.

Keys come from `[security] api_key_file` or `[security] api_keys`, never both: when a key file
is given the TOML must not hold keys in clear as well (ConfigError), so a config that points at
a file can be shared without leaking any key. The key file holds one key per line; blank lines
and lines whose first non-blank character is `#` are ignored; a relative path is resolved
against the router's working directory. With no keys at all the gateway is open (like vLLM
without `--api-key`).

A presented key is checked against every key with `hmac.compare_digest` over SHA-256 digests:
the time taken depends neither on which key matched nor on how long the keys are.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

from control.cluster_config import SecurityConfig
from control.errors import ConfigError

ANONYMOUS = -1  # the key id of every request when the gateway is open


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeys:
    """The set of accepted keys; `match` gives a key's id (its position), used for per-key
    limits and never logged with the key itself."""

    def __init__(self, keys: Iterable[str]):
        self._digests = tuple(_digest(k.encode("utf-8")) for k in keys)

    @classmethod
    def load(cls, security: SecurityConfig) -> ApiKeys:
        """The keys of a `[security]` section; ConfigError for a bad file or both sources."""
        if security.api_key_file and security.api_keys:
            raise ConfigError(
                "[security] api_key_file and api_keys are both set: keys must not be in clear "
                "in the TOML when a key file is given (put every key in the file)"
            )
        if security.api_key_file:
            return cls(read_key_file(security.api_key_file))
        for key in security.api_keys:
            _check_key(key, "[security] api_keys")
        return cls(security.api_keys)

    @property
    def is_open(self) -> bool:
        return not self._digests

    @property
    def num_keys(self) -> int:
        return len(self._digests)

    def match(self, presented: bytes) -> int | None:
        """The id of the key equal to `presented`, else None. Every key is compared (no early
        exit), and on digests, so timing reveals neither which key nor its length."""
        given = _digest(presented)
        hits = [hmac.compare_digest(given, d) for d in self._digests]
        return hits.index(True) if any(hits) else None


def read_key_file(path: str) -> list[str]:
    """Keys of a key file (relative paths resolve against the working directory)."""
    resolved = Path(path).expanduser().resolve()
    try:
        text = resolved.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"[security] api_key_file {resolved}: cannot read ({exc.strerror})"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"[security] api_key_file {resolved}: not UTF-8 text") from None
    keys = []
    for num, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(_check_key(line, f"{resolved}:{num}"))
    if not keys:
        raise ConfigError(f"[security] api_key_file {resolved}: holds no key")
    return keys


def _check_key(key: str, where: str) -> str:
    # A key with whitespace inside cannot be sent as one Bearer token: a typo, say it now.
    if not key or any(c.isspace() for c in key) or not key.isprintable():
        raise ConfigError(f"{where}: an API key must be one word of printable characters")
    return key


class KeyLimiter:
    """Unfinished requests per key id, at most `max_per_key` each (0: unlimited).
    Event-loop only. Every `acquire` that returned True is matched by one `release`."""

    def __init__(self, max_per_key: int):
        self.max_per_key = max_per_key
        self._active: dict[int, int] = {}

    def acquire(self, key_id: int) -> bool:
        num = self._active.get(key_id, 0)
        if self.max_per_key and num >= self.max_per_key:
            return False
        self._active[key_id] = num + 1
        return True

    def release(self, key_id: int) -> None:
        num = self._active.get(key_id, 0) - 1
        if num > 0:
            self._active[key_id] = num
        else:
            self._active.pop(key_id, None)

    def num_active(self, key_id: int | None = None) -> int:
        """Unfinished requests of one key, or of all keys."""
        if key_id is None:
            return sum(self._active.values())
        return self._active.get(key_id, 0)
