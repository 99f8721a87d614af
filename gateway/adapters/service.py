"""Tenants' LoRA adapters as models: register, list, find, delete.

An adapter is registered for a tenant under a ``name`` on a served ``base`` model and becomes the model
``ft:<base>:<tenant>:<name>:<id>`` (OpenAI's ``ft:`` form: the tenant's slug where OpenAI puts the
organisation, ``id`` twelve random hex digits, also the adapter's directory in the store).

Invariants:
- Registration stages the bundle in the adapter store, then asks a healthy replica of the base to read
  and check it (``POST /lora/check``: rank, targets, shapes, dtype, finiteness, size, against the
  replica's own limits) and records the adapter with the digest the replica computed. A bundle a replica
  refuses is a 400 carrying its reason, and nothing is left behind (no row, no directory); with no
  replica of the base to ask, a 503 (retry), also leaving nothing. A bundle is never first found not to
  fit while serving.
- A tenant's live adapters have distinct names (the database's partial unique index decides races), at
  most ``max_adapters_per_tenant`` of them.
- Every lookup is scoped to one tenant: another tenant's adapter is reported exactly like a model that
  does not exist (``ModelNotFoundError``), on every endpoint.
- Deleting marks the row (the ledger keeps naming its model) and, after the commit, removes the bundle
  (``AdapterStore.remove``) and tells every gateway to forget it (``gateway.adapters.directory``).
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import anyio
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from engine.protocol import AdapterCheckResponse
from gateway.adapters.bundle import BundleError
from gateway.adapters.store import AdapterStore
from gateway.engine_client import EngineClient, EngineUnavailable
from gateway.errors import GatewayError, InvalidRequestError, ModelNotFoundError, ServiceUnavailableError
from gateway.routing import Router
from gateway.tenants.repository import AuditLogRepository
from tollgate.models import Adapter, Tenant
from tollgate.settings import Settings

logger = logging.getLogger("tollgate.gateway.adapters")

PREFIX = "ft:"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_MODEL_ID = 128  # the ledger's model column


class AdapterExistsError(GatewayError):
    status = 409

    def __init__(self, name: str) -> None:
        super().__init__(f"An adapter named '{name}' already exists; delete it first or choose another name.",
                         param="name", code="adapter_exists")


def is_adapter_model(model: str) -> bool:
    return model.startswith(PREFIX)


def tenant_slug(tenant: Tenant) -> str:
    """The tenant's part of its adapters' model ids: its name in lower case, runs of anything but letters
    and digits as one hyphen, at most 32 characters (``t<id>`` when nothing is left)."""
    slug = re.sub(r"[^a-z0-9]+", "-", tenant.name.lower()).strip("-")[:32].strip("-")
    return slug or f"t{tenant.id}"


def adapter_model_id(base: str, tenant: Tenant, name: str, adapter_id: str) -> str:
    return f"{PREFIX}{base}:{tenant_slug(tenant)}:{name}:{adapter_id}"


@dataclass
class AdapterModels:
    """The adapters of the platform (one per process; sessions come from the caller's unit of work)."""

    settings: Settings
    router: Router
    engine: EngineClient
    store: AdapterStore

    async def register(self, session: AsyncSession, tenant: Tenant, name: str, base: str,
                       fill: Callable[[Path], None], file_id: str | None = None,
                       actor: str | None = None) -> Adapter:
        """Register the bundle ``fill(directory)`` writes as adapter ``name`` of ``tenant`` on ``base``;
        commits (with an ``adapter.create`` audit row when an admin, ``actor``, registers it). Raises the
        error to answer with, leaving nothing behind (see the module invariants)."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidRequestError(
                "Invalid 'name': 1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit.",
                param="name", code="invalid_value")
        if base not in self.router.models:
            raise ModelNotFoundError(base)
        adapter_id = secrets.token_hex(6)
        model = adapter_model_id(base, tenant, name, adapter_id)
        if len(model) > MAX_MODEL_ID:
            raise InvalidRequestError(
                f"Invalid 'name': the model id {model!r} would be longer than {MAX_MODEL_ID} characters.",
                param="name", code="invalid_value")
        await self._check_room(session, tenant.id, name)
        try:
            await anyio.to_thread.run_sync(self.store.stage, adapter_id, fill)
        except BundleError as exc:
            param = "file_id" if file_id else "file"
            raise InvalidRequestError(f"Invalid adapter bundle: {exc}", param=param,
                                      code="invalid_adapter") from None
        try:
            checked = await self._check(base, adapter_id, "file_id" if file_id else "file")
            row = Adapter(id=adapter_id, model=model, tenant_id=tenant.id, name=name, base_model=base,
                          digest=checked.digest, rank=checked.rank, target_modules=checked.target_modules,
                          bytes=checked.num_bytes, file_id=file_id, created_at=datetime.now(UTC))
            session.add(row)
            if actor is not None:
                await _audit(session, actor, "adapter.create", row)
            try:
                await session.commit()
            except IntegrityError:
                await session.rollback()
                raise AdapterExistsError(name) from None
        except BaseException:
            await anyio.to_thread.run_sync(self.store.remove, adapter_id)
            raise
        return row

    async def _check_room(self, session: AsyncSession, tenant_id: int, name: str) -> None:
        live = select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.deleted_at.is_(None))
        if (await session.execute(live.where(Adapter.name == name))).first() is not None:
            raise AdapterExistsError(name)
        count = (await session.execute(select(func.count()).select_from(live.subquery()))).scalar_one()
        if count >= self.settings.max_adapters_per_tenant:
            raise InvalidRequestError(
                f"This organization already has {count} adapters, the most it may hold; delete one first.",
                param="name", code="adapter_limit_reached")

    async def _check(self, base: str, adapter_id: str, param: str) -> AdapterCheckResponse:
        """A healthy replica of ``base`` reads and checks the staged bundle (see the module invariants)."""
        replicas = [r for r in self.router.models[base].replicas if r.healthy and not r.draining]
        for replica in replicas:
            try:
                return await self.engine.check_adapter(replica.url, adapter_id)
            except EngineUnavailable as exc:
                logger.warning("replica %s could not check adapter %s: %s", replica.url, adapter_id,
                               exc.message)
                continue
            except InvalidRequestError as exc:  # the replica's reason, without its store id
                reason = exc.message.removeprefix(f"adapter {adapter_id!r}: ")
                raise InvalidRequestError(f"Invalid adapter bundle for `{base}`: {reason}", param=param,
                                          code="invalid_adapter") from None
        raise ServiceUnavailableError(
            f"No replica of the model `{base}` can check the adapter right now. Please retry shortly.",
            headers={"retry-after": "5"})


async def list_adapters(session: AsyncSession, tenant_id: int) -> list[Adapter]:
    """The tenant's live adapters, oldest first."""
    rows = await session.execute(
        select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.deleted_at.is_(None))
        .order_by(Adapter.created_at, Adapter.id))
    return list(rows.scalars())


async def get_adapter(session: AsyncSession, tenant_id: int, model: str) -> Adapter:
    row = (await session.execute(select(Adapter).where(
        Adapter.model == model, Adapter.tenant_id == tenant_id, Adapter.deleted_at.is_(None)))).scalar()
    if row is None:
        raise ModelNotFoundError(model)
    return row


async def _audit(session: AsyncSession, actor: str, action: str, row: Adapter) -> None:
    await AuditLogRepository(session).record(actor, action, tenant_id=row.tenant_id, details={
        "model": row.model, "base_model": row.base_model, "digest": row.digest, "rank": row.rank})


async def delete_adapter(session: AsyncSession, tenant_id: int, model: str,
                         actor: str | None = None) -> Adapter:
    """Mark the tenant's adapter deleted (with an ``adapter.delete`` audit row when an admin, ``actor``,
    deletes it); the caller commits, then removes its bundle (``AdapterStore.remove``, in a thread) and
    tells the gateways (``{"adapter_model": ...}``)."""
    row = (await session.execute(
        update(Adapter).where(Adapter.model == model, Adapter.tenant_id == tenant_id,
                              Adapter.deleted_at.is_(None))
        .values(deleted_at=datetime.now(UTC)).returning(Adapter))).scalar()
    if row is None:
        raise ModelNotFoundError(model)
    if actor is not None:
        await _audit(session, actor, "adapter.delete", row)
    return row
