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
            import tollgate.gateway_app  # noqa: F401 - loaded once here; the workers are forked with it

            _forking_multiprocess()(config, sockets=[config.bind_socket()]).run()
        else:
            server = uvicorn.Server(config)
            server.run()
            if not server.started:
                raise SystemExit(3)  # uvicorn's STARTUP_FAILURE
    finally:
        if created:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def worker_pids(parent: int) -> list[int]:
    """The worker processes of the ``tollgate gateway`` whose pid is ``parent``: its children (forked, so
    their command line is the parent's), not a multiprocessing resource tracker should one run."""
    from tollgate.processes import children

    workers = []
    for pid in children(parent):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if b"resource_tracker" not in cmdline:
            workers.append(pid)
    return workers


def _forking_multiprocess() -> type:
    """uvicorn's worker supervisor (``Multiprocess``), with two changes:

    - On Linux, workers are forked from this parent, which has imported the app's modules (nothing more: no
      thread, event loop, connection or app object exists here to be copied; each worker builds its app
      from ``create_app`` as before). uvicorn spawns them, and each spawned worker imports everything
      again: ~2.5 s of CPU per worker, and per replacement of a crashed one, which a forked worker skips
      (it also shares those modules' memory with its siblings). Prometheus' multiprocess values follow
      the fork (they key their files by pid).
    - On SIGTERM/SIGINT the parent closes its copy of the listening socket before signalling the workers.
      Otherwise the kernel keeps accepting connections into the backlog of a socket no worker serves any
      more, and clients hang until the parent exits instead of being refused (and retried elsewhere) at
      once.

    The methods below that start workers are uvicorn's own, with ``ForkedWorker`` for ``Process``."""
    import multiprocessing
    import signal
    import sys
    from socket import socket

    from uvicorn._subprocess import subprocess_started
    from uvicorn.config import STARTUP_FAILURE, Config
    from uvicorn.supervisors.multiprocess import SIGNALS, Multiprocess, Process, logger

    # Linux only: macOS' system libraries are not safe to use after a fork (Python spawns there too).
    forking = multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None

    class ForkedWorker(Process):
        def __init__(self, config: Config, sockets: list[socket]) -> None:
            super().__init__(config, sockets)  # a spawned worker, not started: kept where there is no fork
            if forking is not None:
                self.process = forking.Process(target=self._forked, args=(sockets,))  # type: ignore[assignment]

        def _forked(self, sockets: list[socket]) -> None:
            # The parent's handlers only queue signals for its own loop; a spawned worker would start
            # with Python's defaults, which uvicorn's server then replaces for SIGINT and SIGTERM.
            for sig in SIGNALS:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
            subprocess_started(self.config, self.target, sockets, None)

    class ForkingMultiprocess(Multiprocess):
        def init_processes(self) -> None:
            for _ in range(self.processes_num):
                process = ForkedWorker(self.config, self.sockets)
                process.start()
                self.processes.append(process)

        def restart_all(self) -> None:  # SIGHUP
            for idx, old_process in enumerate(self.processes):
                if self.should_exit.is_set():
                    return
                new_process = ForkedWorker(self.config, self.sockets)
                new_process.start()
                if not new_process.wait_until_ready(self.config.timeout_worker_healthcheck, self.should_exit):
                    new_process.kill()
                    new_process.join()
                    if not self.should_exit.is_set():
                        logger.error(f"New child process [{new_process.pid}] was not ready in time; keeping "
                                     f"worker [{old_process.pid}] and aborting the restart.")  # fmt: skip
                    return
                old_process.terminate()
                old_process.join()
                self.processes[idx] = new_process

        def keep_subprocess_alive(self) -> None:
            if self.should_exit.is_set():
                return
            for idx, process in enumerate(self.processes):
                if process.is_alive(timeout=self.config.timeout_worker_healthcheck):
                    continue
                process.kill()  # hung
                process.join()
                if process.exitcode == STARTUP_FAILURE:  # the app cannot start: every restart would fail
                    logger.error(f"Child process [{process.pid}] failed to start, stopping the parent.")
                    self.should_exit.set()
                    return
                if self.should_exit.is_set():
                    return
                logger.info(f"Child process [{process.pid}] died")
                process = ForkedWorker(self.config, self.sockets)
                process.start()
                self.processes[idx] = process

        def terminate_all(self) -> None:  # called once, when the parent stops
            for sock in self.sockets:
                sock.close()
            super().terminate_all()

    return ForkingMultiprocess
