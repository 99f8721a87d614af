"""Running a service call from a click command: one unit of work, errors as clean CLI messages."""

from __future__ import annotations

import asyncio
import getpass
from collections.abc import Awaitable, Callable
from typing import TypeVar

import click
from sqlalchemy.ext.asyncio import AsyncSession

from tollgate.settings import Settings

T = TypeVar("T")


def cli_actor() -> str:
    """The ``audit_log`` actor of a change made from the command line: ``cli:<user>``."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return "cli"


def run_in_session(settings: Settings, work: Callable[[AsyncSession], Awaitable[T]]) -> T:
    """Run ``work(session)`` in a committed-on-success unit of work and return its result.

    Domain errors (``gateway.tenants.service.TenantError``, ``gateway.errors.GatewayError``) and a
    missing database URL become ``click.ClickException`` (message, exit status 1) instead of tracebacks.
    """
    from gateway.errors import GatewayError
    from gateway.tenants.service import TenantError
    from tollgate.db import Database

    async def main() -> T:
        db = Database.from_settings(settings)
        try:
            async with db.session() as session:
                return await work(session)
        finally:
            await db.dispose()

    try:
        return asyncio.run(main())
    except (TenantError, GatewayError, RuntimeError) as e:
        raise click.ClickException(str(e)) from e
