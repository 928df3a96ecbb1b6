"""deploy/grafana/duet-serve.json: every metric name its PromQL reads is exported by a live
router's /metrics (the real router app against fake nodes, after one request so the histograms
have samples), the panels the operator needs are there, and the name extraction itself is
right on hand-written PromQL."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

from control.tokenizer import Tokenizer
from deploy.grafana import (
    exported_names,
    expressions,
    load_dashboard,
    metric_names,
    missing_metrics,
)
from tinymodel.make import ensure_tiny_model


def _router_fakes():
    """tests/router/router_fakes.py (that folder is not on the path when only this one runs)."""
    if "router_fakes" in sys.modules:
        return sys.modules["router_fakes"]
    path = Path(__file__).resolve().parents[1] / "router" / "router_fakes.py"
    spec = importlib.util.spec_from_file_location("router_fakes", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["router_fakes"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dashboard():
    return load_dashboard()


@pytest.fixture(scope="module")
def live_metrics():
    """/metrics of the router over a 2P1D fake cluster after one finished request."""
    fakes_module = _router_fakes()
    model_dir = str(ensure_tiny_model())
    tok = Tokenizer(model_dir)
    cfg = fakes_module.fake_config(2, 1)
    fakes = fakes_module.FakeCluster(cfg, tok.encode("one two three four"), tok.eos_token_ids[0])
    fakes.start()
    server = fakes_module.RouterServer(cfg, model_dir)
    try:
        server.start()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200
        yield httpx.get(server.url + "/metrics", timeout=5).text
    finally:
        server.stop()
        fakes.stop()


@pytest.mark.parametrize(
    "expr,names",
    [
        (
            "histogram_quantile(0.99, sum by (le) (rate(duet_ttft_seconds_bucket[$__rate_interval])))",
            {"duet_ttft_seconds_bucket"},
        ),
        (
            'sum(rate(a_total{outcome="finished", x=~"$node"}[5m])) / on (node) group_left b',
            {"a_total", "b"},
        ),
        ("c offset 5m > bool 1e3 and d unless e", {"c", "d", "e"}),
        ("max_over_time(up[1m:10s]) * -1", {"up"}),
        ('label_values(duet_node_up{role="decode", a="b"}, node)', {"duet_node_up"}),
        ('sum without (stage) (f{stage="by (x)"})', {"f"}),
    ],
)
def test_metric_names_of_promql(expr, names):
    assert metric_names(expr) == names


def test_exported_names_have_the_type_suffixes():
    text = (
        "# HELP x_total n\n# TYPE x_total counter\n"  # a labelled counter with no child yet
        "# HELP h n\n# TYPE h histogram\n"
        "# HELP g n\n# TYPE g gauge\ng 1.0\n"
    )
    assert exported_names(text) == {"x_total", "h_bucket", "h_count", "h_sum", "g"}


def test_every_dashboard_metric_is_exported_by_a_live_router(dashboard, live_metrics):
    exprs = expressions(dashboard)
    assert len(exprs) >= 20
    assert all(metric_names(e) for e in exprs), "an expression that reads no metric"
    assert missing_metrics(dashboard, live_metrics) == {}
    # and the check has teeth: a renamed metric is caught
    renamed = live_metrics.replace("duet_ttft_seconds", "duet_ttft_s")
    assert "duet_ttft_seconds_bucket" in missing_metrics(dashboard, renamed)


def test_dashboard_has_the_operator_panels(dashboard):
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    read = set().union(*map(metric_names, expressions({"panels": panels})))
    wanted = {
        "duet_ttft_seconds_bucket",
        "duet_tpot_seconds_bucket",
        "duet_inter_token_latency_seconds_bucket",
        "duet_requests_total",
        "duet_sla_met_requests_total",
        "duet_sla_attainment_ratio",
        "duet_kv_pages_used",
        "duet_kv_pages_total",
        "duet_stage_seconds_bucket",
        "duet_rejections_total",
        "duet_request_migrations_total",
        "duet_node_up",
        # SLA-aware serving
        "duet_prefix_cache_hit_ratio",
        "duet_prefix_cache_hit_tokens_total",
        "duet_ttft_prediction_error_seconds_bucket",
        "duet_goodput_requests_per_second",
        "duet_router_preemptions_total",
    }
    assert wanted <= read
    for title in ("TTFT", "TPOT", "ITL"):
        (panel,) = [p for p in panels if p["title"].startswith(title)]
        exprs = [t["expr"] for t in panel["targets"]]
        assert any(e.startswith("histogram_quantile(0.5,") for e in exprs), title
        assert any(e.startswith("histogram_quantile(0.99,") for e in exprs), title
    (variable,) = dashboard["templating"]["list"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    uid = "${" + variable["name"] + "}"
    assert all(p["datasource"]["uid"] == uid for p in panels)
    assert all(t["datasource"]["uid"] == uid for p in panels for t in p["targets"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
