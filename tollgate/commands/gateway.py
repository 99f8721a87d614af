"""``tollgate gateway``: the public API server (uvicorn, N worker processes, ``gateway.app:create_app``)."""

from __future__ import annotations

import click


@click.command()
@click.option("--host", default=None, help="Default: TOLLGATE_HOST (127.0.0.1).")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Default: TOLLGATE_PORT (8000).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Worker processes. Default: TOLLGATE_GATEWAY_WORKERS (1).")
def gateway(host: str | None, port: int | None, workers: int | None) -> None:
    """Serve the OpenAI-compatible API and the admin API."""
    import uvicorn

    from tollgate.settings import get_settings

    settings = get_settings()
    uvicorn.run(
        "gateway.app:create_app",
        factory=True,
        host=host or settings.host,
        port=port or settings.port,
        workers=workers or settings.gateway_workers,
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
        proxy_headers=True,
        forwarded_allow_ips="127.0.0.1",
        log_level="info",
        access_log=False,
    )
