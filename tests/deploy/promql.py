"""What the code really exposes to Prometheus, and a small reader of the PromQL that Tollgate ships (the
Grafana dashboard's queries, the PrometheusRule's alert expressions), so that a test can check every
series and label an expression names against it.

``exposed_by_the_code()`` builds the gateway's and an engine replica's prometheus_client registries here,
fed the label values the code itself enumerates (token kinds, rejection reasons, cache tiers, tier moves,
finish reasons), and reads their Prometheus text back, so a series name is exactly what a scrape shows
(``_total``, ``_bucket``, ``vllm:...``). Beside those, only what Prometheus adds to every target (the
``up`` series, the ``instance`` and ``job`` labels) and, where the Prometheus Operator's ServiceMonitors
scrape (the monitoring component), the target labels it adds. Nothing is started: no engine, no gateway
app, no Prometheus.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

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

# What Prometheus itself gives every scrape target: a series, and labels on every sample.
PROMETHEUS_SERIES = {"up"}
TARGET_LABELS = {"instance", "job"}
# What a ServiceMonitor's scrape adds besides (the Prometheus Operator's endpoint relabelling): the
# target's namespace, Service, pod, container and endpoint (port name).
SERVICE_MONITOR_LABELS = TARGET_LABELS | {"namespace", "service", "pod", "container", "endpoint"}
# Labels whose values the code enumerates (fed below from those enumerations): a literal matcher on one
# must name a value the code can produce, or its query matches nothing for ever.
ENUMERATED_LABELS = {"kind", "reason"}
FUNCTIONS = {"sum", "count", "max", "min", "avg", "rate", "irate", "increase", "histogram_quantile",
             "clamp_min", "clamp_max", "topk", "bottomk", "vector", "scalar", "abs", "avg_over_time",
             "min_over_time", "max_over_time"}
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

    def bucket_bounds(self, histogram: str) -> set[float]:
        """The finite ``le`` bounds of a histogram's buckets (``histogram`` without ``_bucket``)."""
        return {float(le) for le in self.values[(f"{histogram}_bucket", "le")] if le != "+Inf"}


def gateway_text() -> bytes:
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


def engine_text() -> bytes:
    lower_tiers = dict.fromkeys(TIER_KINDS, 1)  # host, disk
    stats = EngineStats(
        num_waiting=1, num_running=1, pending_prefill_tokens=1, pending_prefill_tokens_by_priority={0: 1},
        num_kv_blocks=2, kv_usage=0.5, prefix_query_tokens=2, prefix_hit_tokens=1,
        prefix_hit_tokens_by_tier=dict.fromkeys(CACHE_TIERS, 1), kv_tier_blocks=lower_tiers,
        kv_tier_capacity=lower_tiers, kv_tier_moves={f.name: 1 for f in fields(TierCounters)},
        kv_block_bytes=1, num_requests_finished=dict.fromkeys(FinishReason, 1),
        speculation={"drafted_tokens": 2, "accepted_tokens": 1})
    return EngineMetrics(lambda: stats, model="m", pool="interactive").render()


def exposed_by_the_code() -> Exposed:
    found = Exposed()
    found.read(gateway_text())
    found.read(engine_text())
    return found


# A deliberately small PromQL reader: what Tollgate's expressions use, and a failure on the rest.
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


def check(where: str, expr: str, exposed: Exposed, target_labels: set[str], *,
          cumulative_need_rate: bool = True) -> tuple[Query, set[str]]:
    """Fail unless every series ``expr`` names is one the code exposes (or ``up``), every label it
    matches or groups by is on those series or one of ``target_labels``, a literal value of an enumerated
    label is one the code produces, counters and histograms are read through ``rate()`` (unless
    ``cumulative_need_rate`` is off: a label_values() variable) and gauges never are, and a
    ``histogram_quantile`` reads ``_bucket`` series by ``le``. Returns the query and the labels its
    series can carry."""
    query = parse(expr)
    assert query.series, f"{where}: no series in {expr}"
    unknown = query.series - set(exposed.labels) - PROMETHEUS_SERIES
    assert not unknown, f"{where}: {sorted(unknown)} are not exposed by the code: {expr}"
    labels = set(target_labels)
    for name in query.series:
        labels |= exposed.labels.get(name, set())
    for name, matchers in query.selectors:
        for label, op, value in matchers:
            has = exposed.labels.get(name, set()) | target_labels
            assert label in has, f"{where}: {name} has no label {label}"
            if label in ENUMERATED_LABELS and op in ("=", "=~") and re.fullmatch(r"\w+(\|\w+)*", value):
                wrong = set(value.split("|")) - exposed.values[(name, label)]
                assert not wrong, f"{where}: {name} never has {label} {sorted(wrong)}"
    assert query.grouping <= labels, f"{where}: no series has {sorted(query.grouping - labels)}"
    if cumulative_need_rate:
        unrated = (query.series & exposed.cumulative) - query.rated
        assert not unrated, f"{where}: {sorted(unrated)} read without rate(): {expr}"
    assert not query.rated - exposed.cumulative, f"{where}: rate() of a gauge: {expr}"
    if "histogram_quantile" in expr:
        assert all(name.endswith("_bucket") for name in query.series) and "le" in query.grouping, where
    return query, labels
