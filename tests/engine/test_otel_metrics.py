"""``engine.otel_metrics``: which ``OTEL_*`` settings turn the GenAI metrics on (the traces' rules, each
signal reading its own variables), and that off means nothing of OpenTelemetry's loaded or set up for them.

The metrics themselves, exported by a gateway to a real OTLP receiver, are
``tests/gateway/test_genai_metrics.py``'s.
"""

from __future__ import annotations

import pytest

from engine.otel_metrics import configure
from engine.tracing import requested_exporters
from tests.engine.test_engine_tracing import run_without_otel

ENDPOINT = "http://collector.example:4318"


@pytest.mark.parametrize(("environ", "exporters"), [
    ({}, []),
    ({"OTEL_METRIC_EXPORT_INTERVAL": "1000"}, []),  # nothing to export to
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"{ENDPOINT}/v1/metrics"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{ENDPOINT}/v1/traces"}, []),  # the traces' endpoint only
    ({"OTEL_METRICS_EXPORTER": "otlp"}, ["otlp"]),  # the exporter's default endpoint (localhost:4318)
    ({"OTEL_METRICS_EXPORTER": "console,otlp"}, ["console", "otlp"]),
    ({"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc"}, ["otlp"]),
    ({"OTEL_METRICS_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, []),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, ["otlp"]),  # traces off only
    ({"OTEL_SDK_DISABLED": "true", "OTEL_METRICS_EXPORTER": "otlp"}, []),
])
def test_which_settings_turn_metrics_on(environ: dict[str, str], exporters: list[str]) -> None:
    assert requested_exporters(environ, "metrics") == exporters


@pytest.mark.parametrize("environ", [
    {"OTEL_METRICS_EXPORTER": "prometheus"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/json"},
])
def test_a_setting_it_cannot_honour_stops_the_start(environ: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="not supported for metrics|OTEL_METRICS_EXPORTER"):
        requested_exporters(environ, "metrics")


def test_the_provider_is_the_processes_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry import metrics

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", ENDPOINT)
    genai = configure("tollgate-gateway")
    assert genai is not None
    try:
        assert type(metrics.get_meter_provider()).__name__ == "_ProxyMeterProvider"
    finally:
        genai.shutdown()  # nothing was recorded: nothing is sent


# In a fresh interpreter, with no OTEL_* variable set: what the gateway calls at start-up sets nothing up
# and loads nothing more of OpenTelemetry. (The SDK's metrics module itself may be loaded already: redis-py
# imports it for its own, optional, observability.)
UNCONFIGURED = """
import sys
import gateway.api
from engine.otel_metrics import configure
loaded = set(sys.modules)
assert configure("tollgate-gateway") is None
more = sorted(m for m in set(sys.modules) - loaded if m.startswith("opentelemetry"))
assert not more, more
from opentelemetry import metrics
assert type(metrics.get_meter_provider()).__name__ == "_ProxyMeterProvider"
print("unmetered")
"""


def test_unconfigured_processes_load_no_metrics_sdk() -> None:
    done = run_without_otel(UNCONFIGURED)
    assert done.returncode == 0 and done.stdout.strip() == "unmetered", done.stderr[-3000:]


def test_each_process_is_an_instance_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # Several gateway workers share a service.name; their cumulative series must not merge into one.
    from engine.tracing import process_resource

    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    assert process_resource("tollgate-gateway").attributes["service.instance.id"]  # the SDK's, per process
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=gateway-3")
    assert process_resource("tollgate-gateway").attributes["service.instance.id"] == "gateway-3"
