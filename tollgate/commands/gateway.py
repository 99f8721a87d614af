"""``tollgate gateway``: the public API server (uvicorn, N worker processes,
``tollgate.gateway_app:create_app``).

- Metrics: every worker writes its Prometheus values into ``PROMETHEUS_MULTIPROC_DIR`` and any worker's
  ``/metrics`` merges them (``gateway.metrics``). The directory is the one the environment names, emptied
  at start (stale files of an earlier run would be counted), or a private temporary one removed at exit.
- Logs: JSON lines on stderr, carrying the request id (``gateway.logging``).
- SIGTERM drains: no new connections, open responses get up to ``TOLLGATE_DRAIN_TIMEOUT_S`` to finish,
  then are cut and billed as cancelled (``gateway.metrics`` explains the steps).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import click

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _metrics_dir() -> tuple[Path, bool]:
    """(directory, whether we created it); set in the environment before any worker starts."""
    configured = os.environ.get(MULTIPROC_ENV)
    if configured:
        path = Path(configured)
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob("*.db"):
            stale.unlink(missing_ok=True)
        return path, False
    path = Path(tempfile.mkdtemp(prefix="tollgate-gateway-metrics-"))
    os.environ[MULTIPROC_ENV] = str(path)
    return path, True


@click.command()
@click.option("--host", default=None, help="Default: TOLLGATE_HOST (127.0.0.1).")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Default: TOLLGATE_PORT (8000).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Worker processes. Default: TOLLGATE_GATEWAY_WORKERS (1).")
def gateway(host: str | None, port: int | None, workers: int | None) -> None:
    """Serve the OpenAI-compatible API and the admin API."""
    metrics_dir, created = _metrics_dir()
    import uvicorn

    from gateway.logging import log_config
    from tollgate.settings import get_settings

    settings = get_settings()
    config = uvicorn.Config(
        "tollgate.gateway_app:create_app",
        factory=True,
        host=host or settings.host,
        port=port or settings.port,
        workers=workers or settings.gateway_workers,
        timeout_graceful_shutdown=max(1, round(settings.drain_timeout_s)),
        proxy_headers=True,
        forwarded_allow_ips="127.0.0.1",
        log_level="info",
        log_config=log_config("INFO"),
        access_log=False,
    )
    try:
        if config.workers > 1:
            _draining_multiprocess()(config, sockets=[config.bind_socket()]).run()
        else:
            server = uvicorn.Server(config)
            server.run()
            if not server.started:
                raise SystemExit(3)  # uvicorn's STARTUP_FAILURE
    finally:
        if created:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _draining_multiprocess() -> type:
    from uvicorn.supervisors import Multiprocess

    class DrainingMultiprocess(Multiprocess):
        """uvicorn's worker supervisor, except that on SIGTERM/SIGINT the parent closes its copy of the
        listening socket before signalling the workers. Otherwise the kernel keeps accepting connections
        into the backlog of a socket no worker serves any more, and clients hang until the parent exits
        instead of being refused (and retried elsewhere) at once."""

        def terminate_all(self) -> None:  # called once, when the parent stops
            for sock in self.sockets:
                sock.close()
            super().terminate_all()

    return DrainingMultiprocess
