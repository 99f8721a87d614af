"""``engine.tracing``: which ``OTEL_*`` settings turn traces on, and that off means no SDK at all.

The traces themselves, exported to a real OTLP receiver by a gateway and an engine, are
``tests/gateway/test_traces.py``'s.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.tracing import configure, requested_exporters

ENDPOINT = "http://collector.example:4318"


@pytest.mark.parametrize(("environ", "exporters"), [
    ({}, []),
    ({"OTEL_SERVICE_NAME": "gw", "OTEL_TRACES_SAMPLER": "always_on"}, []),  # nothing to export to
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{ENDPOINT}/v1/traces"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),  # the exporter's default endpoint (localhost:4318)
    ({"OTEL_TRACES_EXPORTER": "otlp, console"}, ["otlp", "console"]),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, []),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
])
def test_which_settings_turn_traces_on(environ: dict[str, str], exporters: list[str]) -> None:
    assert requested_exporters(environ) == exporters


@pytest.mark.parametrize("environ", [
    {"OTEL_TRACES_EXPORTER": "zipkin"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
])
def test_a_setting_it_cannot_honour_stops_the_start(environ: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="not supported"):
        requested_exporters(environ)


@pytest.mark.parametrize(("service_name", "expected"),
                         [(None, "tollgate-engine"), ("replica-7", "replica-7")])
def test_service_name_is_the_processes_unless_the_operator_names_one(
        monkeypatch: pytest.MonkeyPatch, service_name: str | None, expected: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", ENDPOINT)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    if service_name is None:
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    else:
        monkeypatch.setenv("OTEL_SERVICE_NAME", service_name)
    tracing = configure("tollgate-engine")
    assert tracing is not None
    try:
        assert tracing.provider.resource.attributes["service.name"] == expected
    finally:
        tracing.shutdown()  # nothing was recorded: nothing is sent


# In a fresh interpreter (this one has loaded the SDK for the tests above), with no OTEL_* variable set:
# what the gateway and the engine call at start-up sets nothing up and loads none of the SDK's tracing.
UNCONFIGURED = """
import sys
from opentelemetry import trace
import gateway.api  # the whole gateway (engine.server adds torch, nothing of OpenTelemetry)
from engine.tracing import configure
assert configure("tollgate-engine") is None and configure("tollgate-gateway") is None
assert "opentelemetry.sdk.trace" not in sys.modules, "the SDK was loaded"
assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
print("untraced")
"""


def run_without_otel(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter whose environment has no ``OTEL_*`` variable."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True,
                          timeout=120)


def test_unconfigured_processes_load_no_sdk() -> None:
    done = run_without_otel(UNCONFIGURED)
    assert done.returncode == 0 and done.stdout.strip() == "untraced", done.stderr[-3000:]
