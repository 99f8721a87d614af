"""The gateway's per-process runtime and the FastAPI dependencies that hand its parts to endpoints.

``GatewayRuntime`` owns everything a gateway process shares between requests: settings, the Redis
client, the database session factory, the one ``httpx`` pool to the engines, the router (with its
health/load poller), the authenticator (with its invalidation listener), admission, the price book
(refreshed in the background) and the tokenizers (loaded once per model). ``start()``/``stop()`` run
in the app's lifespan; it is stored on ``app.state.gateway``.

Dependencies are ``Annotated`` aliases (``Runtime``, ``CurrentPrincipal``, ``RequestId``) so endpoints
stay one-liners.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Annotated, Generic, Self, TypeVar

from fastapi import Depends, Request
from opentelemetry.trace import Tracer
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.price_cache import PriceBookCache
from billing.usage_spool import UsageSpool
from engine.otel_metrics import GenAIMetrics
from engine.tokenizer import Tokenizer
from gateway.adapters.directory import AdapterDirectory
from gateway.adapters.service import AdapterModels
from gateway.adapters.store import AdapterStore, store_root
from gateway.admission import AdmissionController, AdmissionPolicy
from gateway.admission.resp import RedisCommands
from gateway.auth import Authenticator, Principal
from gateway.engine_client import EngineClient
from gateway.errors import ServiceUnavailableError
from gateway.replicas import Resolver
from gateway.routing import ModelRoute, Router
from tollgate.background import cancel_and_wait
from tollgate.process_runtime import ProcessRuntime
from tollgate.settings import Settings
from tollgate.task_sender import TaskSender

logger = logging.getLogger("tollgate.gateway")

PRICE_REFRESH_INTERVAL_S = 10.0


@dataclass(eq=False)
class GatewayRuntime:
    settings: Settings
    redis: Redis
    sessions: async_sessionmaker[AsyncSession]
    engine: EngineClient
    router: Router
    auth: Authenticator
    admission: AdmissionPolicy
    prices: PriceBookCache
    tokenizers: dict[str, Tokenizer] = field(default_factory=dict)
    # What generations on this runtime are metered and priced as (the batch tier's runtime: "batch").
    request_class: str = "interactive"
    # Whether requests authenticate with API keys here (the key cache and its invalidation listener
    # run); batch lines carry their tenant instead.
    authenticates: bool = True
    # Usage records Redis refused, kept on local disk and replayed (``billing.usage_spool``).
    usage_spool: UsageSpool | None = None
    # Generations' spans start from it (``gateway.tracing``); None: tracing is off.
    tracer: Tracer | None = None
    # Generations record the GenAI server metrics in it (``engine.otel_metrics``); None: they are off.
    genai_metrics: GenAIMetrics | None = None
    # Tenants' adapter models: their lookup (cached) and their registration (``gateway.adapters``).
    adapters: AdapterDirectory | None = None
    adapter_models: AdapterModels | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _task_sender: TaskSender | None = None
    _commands: RedisCommands | None = None

    def redis_commands(self) -> RedisCommands:
        """Raw Redis commands on the lean connection (the stored-response writes; made on first use)."""
        if self._commands is None:
            self._commands = RedisCommands(self.redis)
        return self._commands

    def task_sender(self) -> TaskSender:
        """Sends Celery tasks (made on first use: most processes never send one)."""
        if self._task_sender is None:
            self._task_sender = TaskSender(self.settings)
        return self._task_sender

    @classmethod
    def create(cls, settings: Settings, redis: Redis, sessions: async_sessionmaker[AsyncSession],
               resolver: Resolver | None = None) -> Self:
        """The runtime's parts for ``settings`` (a subclass adapts them: ``configure``, ``router_for``,
        ``admission_for``); ``resolver`` resolves the pools' DNS names (default: the system's)."""
        settings = cls.configure(settings)
        engine = EngineClient.for_settings(settings)
        router = cls.router_for(settings, engine, resolver)
        auth = Authenticator(sessions, redis, settings)
        adapters = AdapterDirectory(sessions, router, settings.key_cache_ttl_s)
        auth.listeners.append(adapters.invalidate)
        return cls(settings=settings, redis=redis, sessions=sessions, engine=engine, router=router, auth=auth,
                   adapters=adapters,
                   adapter_models=AdapterModels(settings, router, engine, AdapterStore(store_root(settings))),
                   admission=cls.admission_for(redis, settings),
                   prices=PriceBookCache(sessions, PRICE_REFRESH_INTERVAL_S),
                   usage_spool=UsageSpool(settings.usage_spool_dir or settings.data_dir / "spool",
                                          retry_interval_s=settings.usage_spool_retry_s))  # fmt: skip

    @classmethod
    def configure(cls, settings: Settings) -> Settings:
        return settings

    @classmethod
    def router_for(cls, settings: Settings, engine: EngineClient, resolver: Resolver | None = None) -> Router:
        return Router(settings, engine, resolver)

    @classmethod
    def admission_for(cls, redis: Redis, settings: Settings) -> AdmissionPolicy:
        return AdmissionController(redis, settings)

    async def start(self) -> None:
        """Price book, tokenizers, replica polling and, where requests authenticate, the key cache."""
        await self.prices.start()
        await asyncio.gather(*(self._load_tokenizer(route) for route in self.router.models.values()))
        await self.router.start()
        if self.authenticates:
            await self.auth.start()
        self._tasks.append(asyncio.create_task(self.prices.run(),
                                               name=f"tollgate-{self.request_class}-price-refresh"))
        if self.usage_spool is not None:
            self._tasks.append(asyncio.create_task(self.usage_spool.run(self.redis),
                                                   name=f"tollgate-{self.request_class}-usage-spool"))

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks, what=f"the {self.request_class} runtime")
        self._tasks.clear()
        if self.authenticates:
            await self.auth.stop()
        await self.router.stop()
        await self.engine.aclose()
        if self._commands is not None:
            self._commands.close()

    async def _load_tokenizer(self, route: ModelRoute) -> None:
        if not route.path:
            logger.error("model %s has no checkpoint path: the gateway cannot tokenize for it", route.name)
            return
        try:
            self.tokenizers[route.name] = await asyncio.to_thread(Tokenizer.from_pretrained, route.path)
        except (OSError, ValueError) as exc:
            logger.error("cannot load the tokenizer of model %s from %s: %s", route.name, route.path, exc)

    def tokenizer(self, model: str) -> Tokenizer:
        tokenizer = self.tokenizers.get(model)
        if tokenizer is None:
            raise ServiceUnavailableError(f"The model `{model}` is not available right now (no tokenizer).",
                                          code="model_unavailable")
        return tokenizer


# Dependencies are ``async def`` even when they do not await: FastAPI runs a plain ``def`` dependency in
# the thread pool, a thread hand-off per request per dependency (~14% of a request's CPU, measured).
async def get_runtime(request: Request) -> GatewayRuntime:
    return request.app.state.gateway


Runtime = Annotated[GatewayRuntime, Depends(get_runtime)]


async def get_principal(request: Request, runtime: Runtime) -> Principal:
    return await runtime.auth.authenticate(request.headers.get("authorization"))


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]


async def get_request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id") or ""


RequestId = Annotated[str, Depends(get_request_id)]


R = TypeVar("R", bound=GatewayRuntime)


class WorkerRuntime(ProcessRuntime, Generic[R]):
    """A Celery worker process's loop and connections (``tollgate.process_runtime``) plus, once a task
    needs one, a started gateway runtime of ``runtime_class`` on them (stopped when the process ends)."""

    runtime_class: type[R]

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.runtime: R | None = None

    async def gateway_runtime(self) -> R:
        if self.runtime is None:
            runtime = self.runtime_class.create(self.settings, self.redis, self.db.sessionmaker)
            await runtime.start()
            self.runtime = runtime
        return self.runtime

    def close(self) -> None:
        if self.runtime is not None:
            self.loop.run_until_complete(self.runtime.stop())
        super().close()
