"""The Grafana dashboard queries only metrics the code defines, and covers what operators watch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "infra" / "grafana" / "dashboards" / "sluice.json"

_QUERIED = re.compile(r"\b(sluice_[a-z0-9_]+)")
_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def defined_metrics() -> dict[str, str]:
    """metric name -> kind, from every Prometheus metric constructor in libs/ and services/."""
    out: dict[str, str] = {}
    for path in [*ROOT.joinpath("libs").rglob("*.py"), *ROOT.joinpath("services").rglob("*.py")]:
        text = path.read_text()
        for m in re.finditer(r"""\b(Counter|Gauge|Histogram|Summary)\(\s*["'](sluice_\w+)["']""", text):
            out[m.group(2)] = m.group(1)
    return out


def _base(name: str, kinds: dict[str, str]) -> str:
    if name in kinds:
        return name
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in kinds:
            return name[: -len(suffix)]
    return name


def test_every_queried_metric_exists_in_the_code() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    kinds = defined_metrics()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    queried = {_base(n, kinds) for e in exprs for n in _QUERIED.findall(e)}
    missing = sorted(queried - set(kinds))
    assert not missing, f"the dashboard queries metrics no code defines: {missing}"
    # Counters are only ever read through rate()/increase(); histograms through their buckets.
    for expr in exprs:
        for name in _QUERIED.findall(expr):
            base = _base(name, kinds)
            if kinds.get(base) == "Counter":
                assert name == base + "_total" and re.search(rf"(rate|increase)\({name}\b", expr), expr
            if kinds.get(base) == "Histogram":
                assert name != base, expr


def test_dashboard_covers_the_operator_metrics_and_is_provisioned() -> None:
    text = DASHBOARD.read_text()
    for name in ("sluice_changefeed_checkpoint_lag_seconds", "sluice_sink_rows_applied_total",
                 "sluice_sink_batch_rows_bucket", "sluice_sink_apply_seconds_bucket",
                 "sluice_replication_member_spans", "sluice_replication_sets",
                 "sluice_scheduler_tasks_in_flight",
                 "sluice_leader_epoch", "sluice_dead_letters_total", "sluice_nats_reconnects_total",
                 "sluice_sink_round_seconds_bucket", "sluice_sink_round_errors_total",
                 "sluice_api_http_requests_total"):
        assert name in text, name
    ids = [p["id"] for p in json.loads(text)["panels"]]
    assert len(ids) == len(set(ids))
    source = yaml.safe_load((ROOT / "infra/grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {d["uid"] for d in source["datasources"]}
    used = {t["datasource"]["uid"] for p in json.loads(text)["panels"] for t in p["targets"]}
    assert used <= uids
    provider = yaml.safe_load((ROOT / "infra/grafana/provisioning/dashboards/sluice.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
