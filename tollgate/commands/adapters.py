"""``tollgate adapters ...``: a tenant's LoRA adapters from the command line (``gateway.adapters``).

``create TENANT NAME --base MODEL DIR`` registers the PEFT bundle in directory DIR (``adapter_config.json``
and ``adapter_model.safetensors``) for tenant TENANT (its id or name) on the served model MODEL: the
bundle is copied into the adapter store and checked by a replica of MODEL (the CLI reaches the configured
pools itself, as ``tenants purge-cache`` does), and the new model id is printed as the LAST line of the
output. ``list TENANT`` prints one line per live adapter; ``delete TENANT MODEL_ID`` deletes one (the
bundle leaves the store, gateways are told through Redis). Errors are one-line messages, exit status 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tollgate.commands._async import cli_actor, run_in_session
from tollgate.settings import Settings, get_settings

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

    from tollgate.models import Adapter, Tenant


async def _tenant(session: AsyncSession, ref: str) -> Tenant:
    from sqlalchemy import select

    from gateway.errors import NotFoundError
    from tollgate.models import Tenant

    found = await session.get(Tenant, int(ref)) if ref.isdigit() else (
        await session.execute(select(Tenant).where(Tenant.name == ref))).scalar()
    if found is None:
        raise NotFoundError(f"no tenant {ref!r}")
    return found


def _echo(row: Adapter) -> None:
    click.echo(f"{row.model}  base={row.base_model} rank={row.rank} targets={','.join(row.target_modules)} "
               f"bytes={row.bytes} created={row.created_at:%Y-%m-%dT%H:%M:%SZ}")


class _Platform:
    """What registering needs outside a gateway: the configured pools, probed once, and the store."""

    def __init__(self, settings: Settings) -> None:
        from gateway.adapters.service import AdapterModels
        from gateway.adapters.store import AdapterStore, store_root
        from gateway.engine_client import EngineClient
        from gateway.routing import Router

        self.client = EngineClient.for_settings(settings)
        self.router = Router(settings, self.client)
        self.models = AdapterModels(settings, self.router, self.client, AdapterStore(store_root(settings)))

    async def __aenter__(self) -> Any:
        await self.router.refresh()
        return self.models

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()


@click.group()
def adapters() -> None:
    """Register, list and delete tenants' LoRA adapters (models ft:<base>:<tenant>:<name>:<id>)."""


@adapters.command("create")
@click.argument("tenant")
@click.argument("name")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--base", "base", required=True, help="The served model the adapter was trained on.")
def create(tenant: str, name: str, bundle: Path, base: str) -> None:
    """Register the PEFT bundle in directory BUNDLE as adapter NAME of TENANT; prints the model id last."""
    from gateway.adapters.bundle import copy_dir

    settings = get_settings()

    async def work(session: AsyncSession) -> Adapter:
        owner = await _tenant(session, tenant)
        async with _Platform(settings) as models:
            return await models.register(session, owner, name, base,
                                         lambda dest: copy_dir(bundle, dest, settings.adapter_max_bytes),
                                         actor=cli_actor())

    row = run_in_session(settings, work)
    _echo(row)
    click.echo(row.model)


@adapters.command("list")
@click.argument("tenant")
def list_adapters(tenant: str) -> None:
    """List TENANT's adapters, oldest first."""
    from gateway.adapters.service import list_adapters

    settings = get_settings()

    async def work(session: AsyncSession) -> list[Adapter]:
        return await list_adapters(session, (await _tenant(session, tenant)).id)

    for row in run_in_session(settings, work):
        _echo(row)


@adapters.command("delete")
@click.argument("tenant")
@click.argument("model")
def delete(tenant: str, model: str) -> None:
    """Delete TENANT's adapter model MODEL."""
    from gateway.adapters.service import delete_adapter
    from gateway.adapters.store import AdapterStore, store_root

    settings = get_settings()

    async def work(session: AsyncSession) -> Adapter:
        row = await delete_adapter(session, (await _tenant(session, tenant)).id, model, actor=cli_actor())
        await session.commit()
        return row

    row = run_in_session(settings, work)
    AdapterStore(store_root(settings)).remove(row.id)
    if settings.redis_url:
        from tollgate.commands.tenants import _announce

        _announce(settings, adapter_model=row.model)
    click.echo(f"deleted {row.model}")
