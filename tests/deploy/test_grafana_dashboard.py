"""Tollgate's Grafana dashboard (``deploy/grafana/tollgate.json``) and the ConfigMap that carries it to
Grafana's dashboard sidecar (``deploy/grafana/kustomization.yaml``, a component of the monitoring one).

The dashboard must keep working as the code changes, so every PromQL expression (panels and template
variables) is checked against what the code really exposes: the gateway's and an engine replica's
prometheus_client registries are built here, fed the label values the code itself enumerates (token
kinds, rejection reasons, cache tiers, tier moves, finish reasons), and their Prometheus text is read
back, so a series name is exactly what a scrape shows (``_total``, ``_bucket``, ``vllm:...``). Beside
those, only what Prometheus adds to every target: the ``up`` series and the ``instance`` and ``job``
labels. Nothing is started: no engine, no gateway app, no Prometheus.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import gateway.metrics
from engine.kv.tiers import TierCounters
from engine.metrics import EngineMetrics
from engine.outputs import EngineStats
from engine.sequence import FinishReason
from engine.usage import CACHE_TIERS, KINDS, TIER_KINDS, Usage
from gateway.admission.rejections import REASONS
from gateway.metrics import (
    MULTIPROC_ENV,
    GatewayMetrics,
    observe_generation,
    observe_kv_index,
    observe_rejection,
)
from tests.deploy.manifests import ROOT

DASHBOARD_PATH = ROOT / "deploy" / "grafana" / "tollgate.json"
CONFIGMAP = "tollgate-grafana-dashboard"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# What Prometheus itself gives every scrape target: a series, and labels on every sample.
PROMETHEUS_SERIES = {"up"}
TARGET_LABELS = {"instance", "job"}
# Labels whose values the code enumerates (fed below from those enumerations): a literal matcher on one
# must name a value the code can produce, or its panel stays empty for ever.
ENUMERATED_LABELS = {"kind", "reason"}
FUNCTIONS = {"sum", "count", "max", "min", "avg", "rate", "irate", "increase", "histogram_quantile",
             "clamp_min", "clamp_max", "topk", "bottomk", "vector", "scalar", "abs"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset"}


@dataclass
class Exposed:
    """What the code's registries expose: each series' label names, the values seen for each, which
    series are cumulative (a counter's ``_total``, a histogram's ``_bucket``/``_sum``/``_count``), and
    the family each series belongs to."""

    labels: dict[str, set[str]] = field(default_factory=dict)
    values: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    cumulative: set[str] = field(default_factory=set)
    family: dict[str, str] = field(default_factory=dict)  # series name -> its family's name

    def read(self, text: bytes) -> None:
        for family in text_string_to_metric_families(text.decode()):
            for sample in family.samples:
                if sample.name.endswith("_created"):  # prometheus_client's creation timestamps
                    continue
                self.labels.setdefault(sample.name, set()).update(sample.labels)
                self.family[sample.name] = family.name
                for label, value in sample.labels.items():
                    self.values.setdefault((sample.name, label), set()).add(value)
                if family.type in ("counter", "histogram"):
                    self.cumulative.add(sample.name)


def _gateway_text() -> bytes:
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(MULTIPROC_ENV, raising=False)  # this process's own registry, not shared files
        metrics = GatewayMetrics()
        mp.setattr(gateway.metrics, "gateway_metrics", lambda: metrics)
        metrics.observe_request("/v1/chat/completions", "POST", 200, 0.1)
        metrics.in_flight.inc()
        for reason in REASONS:
            observe_rejection(reason, "default")
        every_kind = Usage(dict.fromkeys(KINDS, 1))
        observe_generation(model="m", tier="default", status="completed", usage=every_kind, ttft_s=0.2,
                           tpot_s=0.02)
        observe_kv_index("http://10.0.0.1:8100", dict.fromkeys(CACHE_TIERS, 1), new_snapshots=1)
        return metrics.render()


def _engine_text() -> bytes:
    lower_tiers = dict.fromkeys(TIER_KINDS, 1)  # host, disk
    stats = EngineStats(
        num_waiting=1, num_running=1, pending_prefill_tokens=1, pending_prefill_tokens_by_priority={0: 1},
        num_kv_blocks=2, kv_usage=0.5, prefix_query_tokens=2, prefix_hit_tokens=1,
        prefix_hit_tokens_by_tier=dict.fromkeys(CACHE_TIERS, 1), kv_tier_blocks=lower_tiers,
        kv_tier_capacity=lower_tiers, kv_tier_moves={f.name: 1 for f in fields(TierCounters)},
        kv_block_bytes=1, num_requests_finished=dict.fromkeys(FinishReason, 1),
        speculation={"drafted_tokens": 2, "accepted_tokens": 1})
    return EngineMetrics(lambda: stats, model="m", pool="interactive").render()


@pytest.fixture(scope="module")
def exposed() -> Exposed:
    found = Exposed()
    found.read(_gateway_text())
    found.read(_engine_text())
    return found


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


# A deliberately small PromQL reader: what the dashboard's expressions use, and a failure on the rest.
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^{}]*)\}")
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_RANGE = re.compile(r"\[[^\]]*\]")
_CLAUSE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_IDENTIFIER = re.compile(r"(?<![A-Za-z0-9_:.$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_RATED = re.compile(r"\b(?:rate|irate|increase)\(\s*([A-Za-z_:][A-Za-z0-9_:]*)")


@dataclass
class Query:
    selectors: list[tuple[str, list[tuple[str, str, str]]]]  # (series, [(label, op, value)])
    series: set[str]
    grouping: set[str]  # labels of by/without/on/ignoring/group_left/group_right
    rated: set[str]


def parse(expr: str) -> Query:
    selectors: list[tuple[str, list[tuple[str, str, str]]]] = []

    def selector(match: re.Match[str]) -> str:
        name, body = match[1], match[2]
        assert name, f"a selector without a series name: {match[0]}"
        matchers = [(m[1], m[2], m[3]) for m in _MATCHER.finditer(body)]
        assert "".join(m[0] for m in _MATCHER.finditer(body)) == body, f"unreadable matchers: {body}"
        selectors.append((name, matchers))
        return " "

    rest = _RANGE.sub(" ", _SELECTOR.sub(selector, expr))
    grouping: set[str] = set()

    def clause(match: re.Match[str]) -> str:
        grouping.update(label.strip() for label in match[1].split(",") if label.strip())
        return " "

    rest = _CLAUSE.sub(clause, rest)
    series = {name for name, _ in selectors}
    for match in _IDENTIFIER.finditer(rest):
        name, call = match[1], match[2]
        if call:
            assert name in FUNCTIONS, f"unknown function {name} in {expr}"
        elif name not in KEYWORDS:
            series.add(name)
    return Query(selectors, series, grouping, set(_RATED.findall(expr)))


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
    known = set(exposed.labels) | PROMETHEUS_SERIES
    for where, expr, legend in _queries(dashboard):
        query = parse(expr)
        assert query.series, f"{where}: no series in {expr}"
        unknown = query.series - known
        assert not unknown, f"{where}: {sorted(unknown)} are not exposed by the code: {expr}"
        labels = set(TARGET_LABELS)
        for name in query.series:
            labels |= exposed.labels.get(name, set())
        for name, matchers in query.selectors:
            for label, op, value in matchers:
                has = exposed.labels.get(name, set()) | TARGET_LABELS
                assert label in has, f"{where}: {name} has no label {label}"
                if label in ENUMERATED_LABELS and op in ("=", "=~") and re.fullmatch(r"\w+(\|\w+)*", value):
                    wrong = set(value.split("|")) - exposed.values[(name, label)]
                    assert not wrong, f"{where}: {name} never has {label} {sorted(wrong)}"
        assert query.grouping <= labels, f"{where}: no series has {sorted(query.grouping - labels)}"
        in_legend = set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend))
        assert in_legend <= labels, f"{where}: legend names {sorted(in_legend - labels)}"
        # Counters and histograms are read as rates; gauges never are.
        if not where.startswith("variable"):
            unrated = (query.series & exposed.cumulative) - query.rated
            assert not unrated, f"{where}: {sorted(unrated)} read without rate(): {expr}"
        assert not query.rated - exposed.cumulative, f"{where}: rate() of a gauge: {expr}"
        if "histogram_quantile" in expr:
            assert all(name.endswith("_bucket") for name in query.series) and "le" in query.grouping, where


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
