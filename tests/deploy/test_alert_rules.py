"""The alerts on the platform's SLOs (``deploy/kubernetes/components/monitoring/prometheus-rules.yaml``, a
PrometheusRule beside the ServiceMonitors), rendered in every overlay that scrapes Tollgate.

An alert that names a series or label the code does not register never fires, and nobody notices: so
every expression is checked against the registries the code builds (``tests/deploy/promql.py``, as the
Grafana dashboard's queries are), with the target labels a ServiceMonitor adds. Then what each alert
promises: TTFT thresholds at each tier's ``ttft_slo_ms`` (and on a bucket bound, so the p95 is exact
there), the engine Services the alerts name are the pools' own, a replica is not called down while it may
still be loading its model, and every alert has a ``for``, a severity, a summary, a description and a
runbook section in docs/operations.md.
"""

from __future__ import annotations

import re
from typing import Any

from tests.deploy.manifests import ROOT, pod_spec, selects
from tests.deploy.promql import SERVICE_MONITOR_LABELS, check, parse
from tollgate.settings import TierConfig, default_tiers

OPERATIONS = ROOT / "docs" / "operations.md"
SEVERITIES = {"warning", "critical"}
# Packages whose modules may register Prometheus metrics: the ones promql.py builds registries of.
METRIC_MODULES = {"gateway/metrics.py", "engine/metrics.py"}
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_THRESHOLD = re.compile(r"(>|>=|<|<=|==|!=)\s*([0-9.]+)\s*$")
_TEMPLATE_LABEL = re.compile(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)")


def seconds(duration: str) -> float:
    parts = _DURATION.findall(duration)
    assert "".join(n + unit for n, unit in parts) == duration, duration
    return sum(int(n) * _SECONDS[unit] for n, unit in parts)


def alerts(manifests) -> list[tuple[str, dict[str, Any]]]:
    """(group name, rule) of every alerting rule rendered in the overlay."""
    return [(group["name"], rule) for prometheus_rule in manifests.of_kind("PrometheusRule")
            for group in prometheus_rule["spec"]["groups"] for rule in group["rules"] if "alert" in rule]


def named(manifests, alert: str) -> list[dict[str, Any]]:
    return [rule for _, rule in alerts(manifests) if rule["alert"] == alert]


def threshold(expr: str) -> tuple[str, float]:
    match = _THRESHOLD.search(expr)
    assert match, f"no comparison with a number at the end of {expr}"
    return match[1], float(match[2])


def tiers(manifests) -> dict[str, TierConfig]:
    """The service tiers of the overlay's tollgate.toml (the settings' defaults where it names none)."""
    configured = manifests.tollgate_toml().get("tiers")
    return {name: TierConfig(**tier) for name, tier in configured.items()} if configured else default_tiers()


def startup_allowance_s(workload: dict[str, Any]) -> float:
    """How long the kubelet lets a container start (load its model) before restarting it."""
    probe = pod_spec(workload)["containers"][0]["startupProbe"]
    return probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]


def test_the_overlays_that_scrape_tollgate_carry_its_alerts(manifests):
    rules = manifests.of_kind("PrometheusRule")
    if not manifests.of_kind("ServiceMonitor"):  # nothing scrapes this overlay: nothing to alert on
        assert rules == [], manifests.overlay
        return
    (rule,) = rules
    assert rule["metadata"]["namespace"] == manifests.namespace
    groups = [group["name"] for group in rule["spec"]["groups"]]
    assert len(groups) == len(set(groups)), groups  # the CRD's list-map key
    assert {alert["alert"] for _, alert in alerts(manifests)} == {
        "TollgateTTFTAboveSLO", "TollgateAPIErrorRateHigh", "TollgateEngineQueueTimeHigh",
        "TollgateInteractivePoolDown", "TollgateEngineReplicaDown", "TollgateEngineNoStepProgress",
        "TollgateEngineKVCacheNearlyFull"}


def test_every_alert_reads_series_and_labels_the_code_exposes(manifests, exposed):
    for group, rule in alerts(manifests):
        where = f"{manifests.overlay}: {group}/{rule['alert']}"
        query, labels = check(where, rule["expr"], exposed, SERVICE_MONITOR_LABELS)
        # An aggregation keeps only its `by` labels: the annotations may name only those.
        kept = query.grouping - {"le"} if query.grouping else labels
        for text in rule["annotations"].values():
            named_labels = set(_TEMPLATE_LABEL.findall(text))
            assert named_labels <= kept, f"{where}: the alert has no {sorted(named_labels - kept)}"


def test_every_alert_waits_has_a_severity_and_says_what_to_do(manifests):
    if not alerts(manifests):
        return
    runbooks = OPERATIONS.read_text().split("\n## Alerts\n", 1)
    assert len(runbooks) == 2, "docs/operations.md has no Alerts section"
    sections = set(re.findall(r"^### (\w+)$", runbooks[1].split("\n## ", 1)[0], re.MULTILINE))
    for _, rule in alerts(manifests):
        name = rule["alert"]
        assert seconds(rule["for"]) >= 60, name  # no page on one bad evaluation
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        # GitHub's anchor of the heading `### <name>`.
        assert rule["annotations"]["runbook"] == f"docs/operations.md#{name.lower()}", name
        assert name in sections, f"{name} has no runbook section under docs/operations.md's Alerts"


def test_ttft_alerts_follow_each_tiers_slo(manifests, exposed):
    rules = named(manifests, "TollgateTTFTAboveSLO")
    if not manifests.of_kind("PrometheusRule"):
        return
    bounds = exposed.bucket_bounds("tollgate_gateway_ttft_seconds")
    by_tier = {}
    for rule in rules:
        query = parse(rule["expr"])
        assert rule["expr"].startswith("histogram_quantile(0.95,") and "tier" in query.grouping
        ((series, matchers),) = query.selectors
        assert series == "tollgate_gateway_ttft_seconds_bucket"
        (tier,) = [value for label, op, value in matchers if label == "tier" and op == "="]
        op, slo_s = threshold(rule["expr"])
        assert op == ">" and tier not in by_tier, rule["expr"]
        by_tier[tier] = slo_s
    slos = {name: tier.ttft_slo_ms / 1000 for name, tier in tiers(manifests).items()}
    assert by_tier == slos, f"{manifests.overlay}: the alerts' thresholds against the tiers' ttft_slo_ms"
    # At a bucket bound, p95 > SLO exactly when more than 5% of first tokens came later than the SLO
    # (between bounds, histogram_quantile interpolates).
    assert set(slos.values()) <= bounds, sorted(set(slos.values()) - bounds)


def test_every_latency_threshold_is_a_bucket_bound(manifests, exposed):
    for _, rule in alerts(manifests):
        if "histogram_quantile" not in rule["expr"]:
            continue
        ((series, _),) = parse(rule["expr"]).selectors
        _, value = threshold(rule["expr"])
        assert value in exposed.bucket_bounds(series.removesuffix("_bucket")), (rule["alert"], value)


def test_the_engine_alerts_name_the_pools_services(manifests):
    engines = {w["metadata"]["name"] for w in manifests.component("engine")}
    monitors = [m for m in manifests.of_kind("ServiceMonitor") if m["metadata"]["name"] == "engines"]
    for _, rule in alerts(manifests):
        services = [(op, value) for _, matchers in parse(rule["expr"]).selectors
                    for label, op, value in matchers if label == "service"]
        for op, value in services:
            assert op in ("=", "=~") and len(monitors) == 1, rule["alert"]
            matched = [s for s in manifests.of_kind("Service") if re.fullmatch(value, s["metadata"]["name"])]
            assert matched, f"{rule['alert']}: no Service matches {value}"
            for service in matched:  # scraped by the engines' ServiceMonitor, and one pool's
                assert selects(monitors[0]["spec"]["selector"], service["metadata"]["labels"]), rule["alert"]
                picked = manifests.selected_workloads(service["spec"]["selector"])
                assert len(picked) == 1 and set(picked) <= engines, (rule["alert"], picked)
    for rule in named(manifests, "TollgateInteractivePoolDown"):
        (matcher,) = [m for _, ms in parse(rule["expr"]).selectors for m in ms if m[0] == "service"]
        service = manifests.get("Service", matcher[2])
        assert manifests.selected_workloads(service["spec"]["selector"]) == ["engine-interactive"]


def test_a_replica_is_not_called_down_while_it_may_still_be_loading(manifests):
    """Its port opens only once the model is loaded: ``up`` is 0 meanwhile."""
    rules = named(manifests, "TollgateEngineReplicaDown")
    if not manifests.of_kind("PrometheusRule"):
        return
    (rule,) = rules
    longest_load = max(startup_allowance_s(engine) for engine in manifests.component("engine"))
    assert seconds(rule["for"]) > longest_load, (rule["for"], longest_load)


def test_only_the_checked_modules_register_prometheus_metrics():
    """The checks above see the gateway's and the engines' registries only. A metric registered anywhere
    else (the usage flush's or the Stripe export's lag, which docs/operations.md says no process exports
    yet) would go unchecked: it fails here until promql.py builds its registry too, and an alert can then
    read it."""
    found = set()
    for package in ("gateway", "engine", "billing", "tollgate", "admin_ui", "kernels"):
        for path in (ROOT / package).rglob("*.py"):
            if re.search(r"^\s*(from|import) prometheus_client\b", path.read_text(), re.MULTILINE):
                found.add(str(path.relative_to(ROOT)))
    assert found == METRIC_MODULES
