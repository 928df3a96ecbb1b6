"""YAML text of Kubernetes manifests: a small deterministic emitter, no dependency.

It writes the subset manifests use (mappings, sequences, strings, ints, bools, null) in
kubectl's layout (sequence items at their key's indent). Strings are plain only when no YAML
reader could take them for anything else (a number, a bool of YAML 1.1 such as `yes` or `on`,
null, a flow or block indicator); multi-line text (the cluster TOML of the ConfigMap) is a
literal block; everything else is double-quoted with JSON escapes, which YAML reads the same.
`yaml.safe_load` of the output gives back the input (tests/deploy/test_k8s.py checks it).
"""

from __future__ import annotations

import json
import re
from typing import Any

_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*")
# Words a YAML 1.1 or 1.2 reader turns into a bool or null when plain.
_RESERVED = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf"}


def dump_all(docs: list[dict[str, Any]], header: str = "") -> str:
    """The documents as one YAML stream (`---` between them), `header` as leading comments."""
    comments = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comments + "---\n".join(_block(doc, 0) for doc in docs)


def scalar(value: Any) -> str:
    """One scalar as YAML text (a string is quoted unless plain is unambiguous)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if _PLAIN.fullmatch(value) and value.lower() not in _RESERVED:
            return value
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"cannot write {type(value).__name__} {value!r} to YAML")


def _is_literal_block(text: str) -> bool:
    lines = text.splitlines()
    return (
        "\n" in text
        and text.endswith("\n")
        and not text.endswith("\n\n")
        and not text.startswith((" ", "\n"))
        and all(line == line.rstrip() and line.isprintable() for line in lines)
    )


def _value(value: Any, indent: int) -> str:
    """What follows `key:` (or `- `): inline for scalars and empty collections, else a newline
    and the nested block."""
    if isinstance(value, dict) and value:
        return "\n" + _block(value, indent + 2)
    if isinstance(value, list) and value:
        return "\n" + _block(value, indent)
    if isinstance(value, dict):
        return " {}\n"
    if isinstance(value, list):
        return " []\n"
    if isinstance(value, str) and _is_literal_block(value):
        pad = " " * (indent + 2)
        return " |\n" + "".join(
            f"{pad}{line}\n" if line else "\n" for line in value.split("\n")[:-1]
        )
    return f" {scalar(value)}\n"


def _block(value: dict | list, indent: int) -> str:
    pad = " " * indent
    out = []
    if isinstance(value, dict):
        for key, item in value.items():
            out.append(f"{pad}{scalar(key)}:{_value(item, indent)}")
        return "".join(out)
    for item in value:
        if isinstance(item, dict) and item:
            # The first key shares the dash's line; the rest align under it.
            body = _block(item, indent + 2)
            out.append(f"{pad}- {body[indent + 2 :]}")
        elif isinstance(item, list) and item:
            raise TypeError("a sequence directly inside a sequence is not written")
        else:
            out.append(f"{pad}-{_value(item, indent)}")
    return "".join(out)
