"""Tollgate's Grafana dashboard (``deploy/grafana/tollgate.json``) and the ConfigMap that carries it to
Grafana's dashboard sidecar (``deploy/grafana/kustomization.yaml``, a component of the monitoring one).

The dashboard must keep working as the code changes, so every PromQL expression (panels and template
variables) is checked against what the code really exposes (``tests/deploy/promql.py``: the gateway's and
an engine replica's registries, built in-process), with only the labels Prometheus adds to every target
(``instance``, ``job``): the dashboard also serves a plain scrape config, without the Prometheus Operator.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.deploy.manifests import ROOT
from tests.deploy.promql import TARGET_LABELS, check, parse

DASHBOARD_PATH = ROOT / "deploy" / "grafana" / "tollgate.json"
CONFIGMAP = "tollgate-grafana-dashboard"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_PATH.read_text())


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    return [p for panel in panels for p in (panel, *_panels(panel.get("panels", [])))]


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(where, PromQL, legend) of every panel target and every query variable (its series selector,
    ``where`` starting with ``variable``)."""
    found = [(f"panel {p['id']} {p['title']!r}", t["expr"], t.get("legendFormat", ""))
             for p in _panels(dashboard["panels"]) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = re.fullmatch(r"label_values\((.+),\s*([A-Za-z_][A-Za-z0-9_]*)\)", query)
            assert match, f"variable {variable['name']}: {query}"
            found.append((f"variable {variable['name']}", match[1], f"{{{{{match[2]}}}}}"))
    return found


def test_the_reader_sees_what_an_expression_names():
    query = parse('sum by (pool, tier) (rate(a_total{model=~"$model", kind="x"}[$__rate_interval])) '
                  "/ ignoring (tier) group_left sum by (pool) (b) > 0")
    assert query.series == {"a_total", "b"} and query.rated == {"a_total"}
    assert query.grouping == {"pool", "tier"}
    assert query.selectors == [("a_total", [("model", "=~", "$model"), ("kind", "=", "x")])]
    with pytest.raises(AssertionError):
        parse("sum(rat(a_total[5m]))")


def test_the_dashboard_is_grafana_json_with_unique_panel_ids(dashboard):
    assert dashboard["uid"] == "tollgate" and dashboard["title"]
    assert dashboard["schemaVersion"] >= 39
    panels = _panels(dashboard["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    taken: dict[tuple[int, int], int] = {}
    for panel in panels:  # no two panels on one grid cell (Grafana would shuffle them)
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in taken, f"panels {taken[(x, y)]} and {panel['id']} overlap"
                taken[(x, y)] = panel["id"]


def test_every_panel_queries_the_datasource_variable(dashboard):
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    for panel in _panels(dashboard["panels"]):
        if panel["type"] == "row":
            assert not panel.get("targets"), panel["title"]
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", DATASOURCE) == DATASOURCE, panel["title"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE, variable["name"]


def test_the_variables_cover_model_tier_pool_and_replica(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "model", "tier", "pool", "replica"} <= set(variables)
    defined = set(variables) | {"__rate_interval", "__interval", "__range"}
    for where, expr, _ in _queries(dashboard):
        used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", expr))
        assert used <= defined, f"{where}: undefined variables {used - defined}"


def test_every_series_and_label_the_dashboard_queries_is_one_the_code_exposes(dashboard, exposed):
    for where, expr, legend in _queries(dashboard):
        # A variable's label_values() lists a counter's series as well as a gauge's.
        _, labels = check(where, expr, exposed, TARGET_LABELS,
                          cumulative_need_rate=not where.startswith("variable"))
        in_legend = set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend))
        assert in_legend <= labels, f"{where}: legend names {sorted(in_legend - labels)}"


def test_every_metric_family_is_on_a_panel_or_named_here(dashboard, exposed):
    """A family the code adds shows up here until a panel reads it (or it is listed, with why not)."""
    not_on_a_panel = {
        "tollgate_engine_kv_blocks",  # the pool's size: "KV cache usage" shows the held fraction of it
        "vllm:kv_cache_usage_perc",  # tollgate_engine_kv_cache_usage under vLLM's name
    }
    used = set()
    for _, expr, _ in _queries(dashboard):
        used |= {exposed.family.get(name, name) for name in parse(expr).series}
    missing = set(exposed.family.values()) - used - not_on_a_panel
    assert not missing, sorted(missing)


def test_the_monitoring_overlays_carry_the_dashboard_for_grafanas_sidecar(rendered):
    text = DASHBOARD_PATH.read_text()
    carried = []
    for overlay, manifests in rendered.items():
        configmaps = [c for c in manifests.of_kind("ConfigMap") if c["metadata"]["name"] == CONFIGMAP]
        if not manifests.of_kind("ServiceMonitor"):  # no Prometheus scrapes this overlay: no dashboard
            assert configmaps == [], overlay
            continue
        (configmap,) = configmaps  # one name, no hash: a changed dashboard replaces the old one
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1", overlay
        assert configmap["metadata"]["namespace"] == manifests.namespace, overlay
        assert configmap["data"] == {"tollgate.json": text}, overlay
        carried.append(overlay)
    assert carried  # the production overlays scrape, and show what they scrape
