"""The Grafana dashboard (`deploy/grafana/duet-serve.json`) against the router's `/metrics`.

`missing_metrics` lists every metric name the dashboard's PromQL reads that a scrape does not
export, so a renamed metric fails CI instead of leaving a panel silently empty
(`tests/deploy/test_grafana.py` against the fake-node router, `tests/e2e/test_operator_view.py`
against a real cluster).

PromQL is not parsed in full: string literals, label matchers `{...}`, range selectors `[...]`,
grouping clauses (`by (...)`, `on (...)`, ...) and Grafana variables are cut out, and what is left
that looks like an identifier, is not a function call (`name(`) and not a keyword is a metric
name. That covers the selectors, functions, aggregations and binary operators the dashboard uses.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent / "grafana" / "duet-serve.json"

_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
    | {"group_left", "group_right", "inf", "nan", "atan2"}
)
_CUT = (
    re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`'),  # string literals
    re.compile(r"\{[^}]*\}"),  # label matchers (and ${variable})
    re.compile(r"\[[^\]]*\]"),  # range and subquery selectors
    re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"),
    re.compile(r"\$\w+"),  # Grafana variables
)
_LABEL_VALUES = re.compile(r"\blabel_values\s*\(([^,)]*)(?:,[^)]*)?\)")  # Grafana's, not PromQL
# An identifier, whole (not a piece of a longer one), that is not a function call.
_NAME = re.compile(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*(?![\w:]|\s*\()")
# The series a family of each type exposes (counters are exposed with _total only).
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("_count", "_sum", ""),
    "gauge": ("",),
}


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: each panel target's `expr` (panels inside rows too) and each
    query variable's query."""
    exprs = []
    panels = list(dashboard.get("panels", []))
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))
        exprs += [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var.get("query")
            exprs.append(query.get("query", "") if isinstance(query, dict) else str(query))
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` reads (see the module docstring for how)."""
    for pattern in _CUT:
        expr = pattern.sub(" ", expr)
    expr = _LABEL_VALUES.sub(r"\1", expr)
    return {name for name in _NAME.findall(expr) if name.lower() not in _KEYWORDS}


def exported_names(metrics_text: str) -> set[str]:
    """Every series name a scrape exports: its sample names, and each family's name with its
    type's suffixes (a labelled metric that has no child yet shows only HELP and TYPE)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
    return names


def missing_metrics(dashboard: dict[str, Any], metrics_text: str) -> dict[str, list[str]]:
    """{metric name: [expressions reading it]} for each name the scrape does not export."""
    exported = exported_names(metrics_text)
    missing: dict[str, list[str]] = {}
    for expr in expressions(dashboard):
        for name in sorted(metric_names(expr) - exported):
            missing.setdefault(name, []).append(expr)
    return missing
