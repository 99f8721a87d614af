"""``tollgate up``: the whole platform on one machine, under one supervisor.

Order: private Postgres and Redis (unless ``TOLLGATE_DATABASE_URL`` / ``TOLLGATE_REDIS_URL`` name
existing ones) → migrations → demo tenant and key (first start) → tiny model (first start, unless
``--model``) → engine replicas (``--engine-replicas``, one by default: ``engine``; with several,
``engine-0``, ``engine-1``, ... on consecutive ports, each with a disk tier of its own; with
``--prefill-replicas N`` they decode and ``prefill-0``, ... prefill, on the ports after theirs), gateway,
Celery worker and beat → wait for every health check → write ``DATA_DIR/env`` and print it. Then
supervise until SIGINT/SIGTERM, and stop everything, servers last.
This module starts the servers and prepares the data dir; the supervised children's specs (commands,
probes, stop stages) are ``tollgate.platform_children``.

Data dir layout (default ``./.tollgate``; see docs/operations.md):
- ``state.json`` (0600): ports and generated passwords of the private servers, the demo API key, the
  internal token (generated on first start unless ``TOLLGATE_INTERNAL_TOKEN`` is set) that the engine
  demands of the gateway and the worker, which all get it in their environment.
- ``env`` (0600): ``export`` lines for OPENAI_BASE_URL, OPENAI_API_KEY, TOLLGATE_DATABASE_URL,
  TOLLGATE_REDIS_URL.
- ``postgres/`` (the cluster; owned by ``postgres`` when run as root), ``redis/`` (append-only files).
- ``logs/<process>.log``, ``models/tiny/``, ``run/`` (``status.json``, the lock, beat's schedule).

Invariants: one ``tollgate up`` per data dir (a lock); a second start reuses the data, the passwords
and the demo key; passwords and keys are written only to 0600 files and never logged.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import click

from tollgate.platform_children import PYTHON_M, ChildLayout, engine_specs, service_specs
from tollgate.settings import Settings, get_settings

if TYPE_CHECKING:
    from redis import Redis

    from tollgate.supervisor import Supervisor

DEMO_TENANT = "demo"
TINY_MODEL_NAME = "tiny"


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


@dataclass
class Endpoints:
    database_url: str
    redis_url: str


class LocalPlatform:
    def __init__(
        self,
        settings: Settings,
        data_dir: Path,
        *,
        port: int,
        engine_port: int,
        model: Path | None,
        with_engine: bool,
        gateway_workers: int,
        engine_replicas: int = 1,
        prefill_replicas: int = 0,
        out: TextIO = sys.stdout,
    ) -> None:
        self.settings = settings
        self.data_dir = data_dir.resolve()
        self.port = port
        self.engine_port = engine_port
        self.model = model
        self.with_engine = with_engine
        self.gateway_workers = gateway_workers
        self.engine_replicas = engine_replicas
        self.prefill_replicas = prefill_replicas
        self.out = out
        self.state_path = self.data_dir / "state.json"
        self.logs = self.data_dir / "logs"
        self.run_dir = self.data_dir / "run"

    # ------------------------------------------------------------------ helpers

    def report(self, message: str) -> None:
        click.echo(f"tollgate up: {message}", err=True)

    def _load_state(self) -> dict[str, Any]:
        return json.loads(self.state_path.read_text()) if self.state_path.exists() else {}

    def _save_state(self, state: dict[str, Any]) -> None:
        _write_private(self.state_path, json.dumps(state, indent=2))

    def _saved_server(self, state: dict[str, Any], name: str) -> dict[str, Any]:
        """``state[name]``: the server's port (kept while it is free) and password, saved before use."""
        from tollgate.local_services import free_port, port_is_free

        saved = state.setdefault(name, {})
        if not saved.get("port") or not port_is_free(saved["port"]):
            saved["port"] = free_port()
        saved.setdefault("password", secrets.token_urlsafe(24))
        self._save_state(state)
        return saved

    def _lock(self) -> TextIO:
        lock = open(self.run_dir / "up.lock", "a+")  # held (open) for the life of this process
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            lock.close()
            raise click.ClickException(
                f"another `tollgate up` (pid {holder}) is running on {self.data_dir}"
            ) from None
        lock.truncate(0)
        lock.write(str(os.getpid()))
        lock.flush()
        return lock

    def _preflight(self) -> None:
        from tollgate.local_services import port_is_free

        ports = [("gateway", self.port, "--port")]
        if self.with_engine:
            ports += [(name, port, "--engine-port") for name, port, _ in self._engines()]
        for name, port, option in ports:
            if not port_is_free(port):
                raise click.ClickException(
                    f"port {port} for the {name} is in use; choose another with {option}"
                )
        if self.with_engine and self.model is not None and not (self.model / "config.json").is_file():
            raise click.ClickException(
                f"--model {self.model} is not a Hugging Face checkpoint (no config.json)"
            )

    # ------------------------------------------------------------------ steps

    def _start_servers(self, sup: Supervisor, state: dict[str, Any]) -> Endpoints:
        from tollgate.local_services import (
            POSTGRES_STOP_SIGNAL,
            REDIS_STOP_SIGNAL,
            LocalPostgres,
            LocalRedis,
            find_server_binaries,
        )
        from tollgate.supervisor import ProcessSpec

        database_url, redis_url = self.settings.database_url, self.settings.redis_url
        if database_url and redis_url:
            return Endpoints(database_url, redis_url)
        binaries = find_server_binaries(self.settings)  # MissingServerBinaries says what to install
        names = []
        pg: LocalPostgres | None = None
        if not database_url:
            saved = self._saved_server(state, "postgres")
            pg = LocalPostgres(
                self.data_dir / "postgres",
                binaries.postgres_bin_dir,
                port=saved["port"],
                password=saved["password"],
            )
            for change in pg.prepare():
                self.report(change)
            sup.start(
                ProcessSpec(
                    "postgres",
                    pg.argv(),
                    pg.log_path,
                    lambda _p: pg.is_ready(),
                    restart=False,
                    stop_signal=POSTGRES_STOP_SIGNAL,
                    stop_group="data",
                    user=pg.user,
                    cwd=pg.root,
                )
            )
            names.append("postgres")
            database_url = pg.url("postgres")
        if not redis_url:
            saved = self._saved_server(state, "redis")
            rd = LocalRedis(
                self.data_dir / "redis", binaries.redis_server, port=saved["port"], password=saved["password"]
            )
            rd.prepare()
            sup.start(
                ProcessSpec(
                    "redis",
                    rd.argv(),
                    rd.log_path,
                    lambda _p: rd.is_ready(),
                    restart=False,
                    stop_signal=REDIS_STOP_SIGNAL,
                    stop_group="data",
                    cwd=rd.root,
                )
            )
            names.append("redis")
            redis_url = rd.url(0)
        sup.wait_healthy(names, self.settings.startup_timeout_s)
        if pg is not None:
            pg.create_database("tollgate")
            database_url = pg.url("tollgate")
        self.report(f"{' and '.join(names)} ready")
        return Endpoints(database_url, redis_url)

    def _ensure_demo_key(self, endpoints: Endpoints, state: dict[str, Any]) -> str:
        import asyncio

        from gateway.tenants.schemas import ApiKeyCreate, TenantCreate
        from gateway.tenants.service import ApiKeyService, InvalidApiKey, TenantNotFound, TenantService
        from tollgate.db import Database

        settings = self.settings.model_copy(update={"database_url": endpoints.database_url})
        saved = state.get("demo_api_key")

        async def main() -> str | None:
            db = Database.from_settings(settings)
            try:
                async with db.session() as session:
                    keys = ApiKeyService(session, settings)
                    if saved:
                        try:
                            await keys.resolve(saved)
                            return None
                        except InvalidApiKey:
                            self.report("the saved demo key no longer works: creating a new one")
                    tenants = TenantService(session, settings)
                    try:
                        tenant = await tenants.get_tenant(DEMO_TENANT)
                    except TenantNotFound:
                        tenant = await tenants.create_tenant(
                            TenantCreate(name=DEMO_TENANT), actor="tollgate-up"
                        )
                    _, full_key = await keys.create_key(
                        tenant.id, ApiKeyCreate(name="demo (tollgate up)"), actor="tollgate-up"
                    )
                    return full_key
            finally:
                await db.dispose()

        created = asyncio.run(main())
        if created is None and saved:
            return str(saved)
        if created is None:
            raise RuntimeError("no demo key was saved or created")
        state["demo_api_key"] = created
        self._save_state(state)
        self.report(f"created the demo tenant {DEMO_TENANT!r} and its API key")
        return created

    def _ensure_model_price(self, endpoints: Endpoints) -> None:
        """Give the served model its first price (the gateway refuses unpriced models); an operator's
        prices are never touched."""
        import asyncio

        from billing.service import DEMO_PRICE, ensure_price
        from tollgate.db import Database

        name, _ = self._model_dir()
        settings = self.settings.model_copy(update={"database_url": endpoints.database_url})

        async def main() -> bool:
            db = Database.from_settings(settings)
            try:
                async with db.session() as session:
                    return await ensure_price(session, name, DEMO_PRICE)
            finally:
                await db.dispose()

        if asyncio.run(main()):
            self.report(f"priced model {name!r} at the demo price (change it with `tollgate prices set`)")

    def _model_dir(self) -> tuple[str, Path]:
        if self.model is not None:
            return self.model.resolve().name, self.model.resolve()
        return TINY_MODEL_NAME, self.data_dir / "models" / TINY_MODEL_NAME

    def _ensure_model(self, env: dict[str, str]) -> None:
        import subprocess

        _, model_dir = self._model_dir()
        if self.model is not None or (model_dir / "config.json").is_file():
            return
        self.report(f"creating the tiny demo model in {model_dir}")
        log = self.logs / "model.log"
        with log.open("ab") as f:
            result = subprocess.run(
                [*PYTHON_M, "tollgate", "model", "create-tiny", str(model_dir)],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
            )
        if result.returncode != 0:
            from tollgate.supervisor import StartupFailed, log_tail

            raise StartupFailed(f"creating the tiny model failed; {log} ends with:\n{log_tail(log)}")

    def _internal_token(self, state: dict[str, Any]) -> str:
        """The operator's ``TOLLGATE_INTERNAL_TOKEN``, else this data dir's own (made once, kept 0600)."""
        if self.settings.internal_token is not None:
            return self.settings.internal_token.get_secret_value()
        if not state.get("internal_token"):
            state["internal_token"] = secrets.token_urlsafe(32)
            self._save_state(state)
        return str(state["internal_token"])

    def _child_env(self, endpoints: Endpoints, internal_token: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "TOLLGATE_INTERNAL_TOKEN": internal_token,
                "TOLLGATE_DATABASE_URL": endpoints.database_url,
                "TOLLGATE_REDIS_URL": endpoints.redis_url,
                "TOLLGATE_DATA_DIR": str(self.data_dir),
                "TOLLGATE_PORT": str(self.port),
                "TOLLGATE_ENGINE_PORT": str(self.engine_port),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.with_engine:
            name, model_dir = self._model_dir()
            pools = self._layout().pools()
            env["TOLLGATE_MODELS"] = json.dumps([{"name": name, "path": str(model_dir),
                                                  "pools": list(pools)}])
            env["TOLLGATE_POOLS"] = json.dumps(pools)
        return env

    def _layout(self) -> ChildLayout:
        return ChildLayout(self.settings, self.data_dir, self.logs, self.run_dir, port=self.port,
                           engine_port=self.engine_port, engine_replicas=self.engine_replicas,
                           gateway_workers=self.gateway_workers, prefill_replicas=self.prefill_replicas)

    def _engines(self) -> list[tuple[str, int, Path]]:
        return self._layout().engines()

    def _start_platform(self, sup: Supervisor, env: dict[str, str], heartbeat_client: Redis) -> list[str]:
        layout = self._layout()
        specs = engine_specs(layout, self._model_dir()[1], env) if self.with_engine else []
        specs += service_specs(layout, env, heartbeat_client)
        engines = [spec.name for spec in specs if spec.name.startswith("engine")]
        for spec in specs:
            sup.start(spec)
            if engines and spec.name == engines[-1]:
                # The gateway probes its replicas when it starts: with the engines healthy by then, the
                # first request after "tollgate is up" is routed instead of answered 503 until the
                # next poll. (They load their models side by side.)
                sup.wait_healthy(engines, self.settings.startup_timeout_s)
        return [spec.name for spec in specs]

    def _write_env(self, endpoints: Endpoints, api_key: str) -> list[str]:
        import shlex

        lines = [
            f"export OPENAI_BASE_URL={shlex.quote(f'http://127.0.0.1:{self.port}/v1')}",
            f"export OPENAI_API_KEY={shlex.quote(api_key)}",
            f"export TOLLGATE_DATABASE_URL={shlex.quote(endpoints.database_url)}",
            f"export TOLLGATE_REDIS_URL={shlex.quote(endpoints.redis_url)}",
        ]
        _write_private(
            self.data_dir / "env",
            "# written by `tollgate up`; load with: . "
            + shlex.quote(str(self.data_dir / "env"))
            + "\n"
            + "\n".join(lines)
            + "\n",
        )
        return lines

    # ------------------------------------------------------------------ main

    def run(self) -> int:
        from tollgate import schema
        from tollgate.local_services import MissingServerBinaries, ServerStartError
        from tollgate.redis import create_sync_redis
        from tollgate.supervisor import StartupFailed, StopRequested, StopSignals, Supervisor

        for directory in (self.data_dir, self.logs, self.run_dir):
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = self._lock()
        self._preflight()
        state = self._load_state()
        s = self.settings
        heartbeat_client = None
        with StopSignals() as signals:
            sup = Supervisor(
                signals=signals,
                report=self.report,
                health_poll_interval_s=s.health_poll_interval_s,
                restart_backoff_s=s.restart_backoff_s,
                restart_backoff_max_s=s.restart_backoff_max_s,
                stop_timeout_s=s.stop_timeout_s,
                status_path=self.run_dir / "status.json",
                idle_poll_interval_s=s.supervisor_idle_poll_interval_s,
            )
            try:
                endpoints = self._start_servers(sup, state)
                schema.upgrade(endpoints.database_url)
                self.report("database schema at head")
                api_key = self._ensure_demo_key(endpoints, state)
                self._ensure_model_price(endpoints)
                env = self._child_env(endpoints, self._internal_token(state))
                if self.with_engine:
                    self._ensure_model(env)
                heartbeat_client = create_sync_redis(s.model_copy(update={"redis_url": endpoints.redis_url}))
                names = self._start_platform(sup, env, heartbeat_client)
                sup.wait_healthy(names, s.startup_timeout_s)
                lines = self._write_env(endpoints, api_key)
                click.echo("\n".join(lines), file=self.out)
                click.echo(
                    f"tollgate is up: {', '.join(sup.children)}. Logs in {self.logs}; "
                    f"`. {self.data_dir / 'env'}` to use it; Ctrl-C stops everything.",
                    file=self.out,
                )
                self.out.flush()
                code = sup.run()
            except StopRequested:
                code = 0
            except MissingServerBinaries as e:
                self.report(str(e))
                code = 1
            except (StartupFailed, ServerStartError) as e:
                self.report(f"startup failed: {e}")
                code = 1
            finally:
                self.report("stopping")
                sup.stop_all()
                if heartbeat_client is not None:
                    heartbeat_client.close()
                lock.close()
        self.report("stopped")
        return code


@click.command()
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the private servers, logs and state live. Default: TOLLGATE_DATA_DIR (./.tollgate).",
)
@click.option(
    "--port", type=click.IntRange(1, 65535), default=None, help="Gateway port. Default: TOLLGATE_PORT."
)
@click.option(
    "--engine-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Engine replica port. Default: TOLLGATE_ENGINE_PORT.",
)
@click.option(
    "--model",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Hugging Face checkpoint directory to serve. Default: a generated tiny model.",
)
@click.option(
    "--no-engine",
    is_flag=True,
    help="Start no local engine (the gateway uses the replicas configured in tollgate.toml).",
)
@click.option(
    "--workers",
    "--gateway-workers",
    "gateway_workers",
    type=click.IntRange(min=1),
    default=None,
    help="Gateway worker processes. Default: TOLLGATE_GATEWAY_WORKERS.",
)
@click.option(
    "--engine-replicas",
    type=click.IntRange(1, 16),
    default=None,
    help="Engine replicas of the model (consecutive ports from --engine-port). Default: "
    "TOLLGATE_ENGINE_REPLICAS (1).",
)
@click.option(
    "--prefill-replicas",
    type=click.IntRange(0, 16),
    default=None,
    help="Disaggregated serving: prefill replicas of the model (on the ports after the engine replicas'); "
    "the engine replicas then decode. Default: TOLLGATE_ENGINE_PREFILL_REPLICAS (0: none).",
)
@click.option(
    "--decode-replicas",
    type=click.IntRange(1, 16),
    default=None,
    help="With --prefill-replicas: the decode replicas (the engine replicas; same as --engine-replicas).",
)
@click.option(
    "--engine-tensor-parallel-size",
    type=click.IntRange(1, 64),
    default=None,
    help="Ranks (GPUs, or CPU processes) each engine replica splits the model over. Default: "
    "TOLLGATE_ENGINE_TENSOR_PARALLEL_SIZE (1).",
)
def up(
    data_dir: Path | None,
    port: int | None,
    engine_port: int | None,
    model: Path | None,
    no_engine: bool,
    gateway_workers: int | None,
    engine_replicas: int | None,
    prefill_replicas: int | None,
    decode_replicas: int | None,
    engine_tensor_parallel_size: int | None,
) -> None:
    """Run the whole platform on this machine until Ctrl-C."""
    from tollgate.local_services import MissingServerBinaries, find_server_binaries

    settings = get_settings()
    if decode_replicas is not None and engine_replicas is not None and decode_replicas != engine_replicas:
        raise click.UsageError("--decode-replicas and --engine-replicas name the same replicas: give one")
    engine_replicas = decode_replicas or engine_replicas
    prefill_replicas = settings.engine_prefill_replicas if prefill_replicas is None else prefill_replicas
    if decode_replicas is not None and not prefill_replicas:
        raise click.UsageError("--decode-replicas needs --prefill-replicas (else use --engine-replicas)")
    if engine_tensor_parallel_size is not None:
        settings = settings.model_copy(update={"engine_tensor_parallel_size": engine_tensor_parallel_size})
    if not (settings.database_url and settings.redis_url):
        try:
            find_server_binaries(settings)
        except MissingServerBinaries as e:
            raise click.ClickException(str(e)) from e
    platform = LocalPlatform(
        settings,
        data_dir or settings.data_dir,
        port=port or settings.port,
        engine_port=engine_port or settings.engine_port,
        model=model,
        with_engine=not no_engine,
        gateway_workers=gateway_workers or settings.gateway_workers,
        engine_replicas=engine_replicas or settings.engine_replicas,
        prefill_replicas=prefill_replicas,
    )
    sys.exit(platform.run())
