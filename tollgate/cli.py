"""The ``tollgate`` command. Subcommands live in ``tollgate/commands/``, one module per group, and
import their heavy dependencies inside the command so that ``tollgate --help`` stays fast."""

from __future__ import annotations

import importlib

import click

# (command name, module, attribute): loaded lazily on first use.
_COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("tollgate.commands.up", "up"),
    "migrate": ("tollgate.commands.db", "migrate"),
    "tenants": ("tollgate.commands.tenants", "tenants"),
    "keys": ("tollgate.commands.tenants", "keys"),
    "model": ("tollgate.commands.model", "model"),
    "engine": ("tollgate.commands.model", "engine"),
    "fetch-model": ("tollgate.commands.model_fetch", "fetch_model"),
    "gateway": ("tollgate.commands.gateway", "gateway"),
    "prices": ("tollgate.commands.prices", "prices"),
    "batches": ("tollgate.commands.batches", "batches"),
    "billing": ("tollgate.commands.billing", "billing"),
    "statements": ("tollgate.commands.statements", "statements"),
    "admins": ("tollgate.commands.admins", "admins"),
    "adapters": ("tollgate.commands.adapters", "adapters"),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _COMMANDS:
            return None
        module, attr = _COMMANDS[name]
        return getattr(importlib.import_module(module), attr)


@click.group(cls=_LazyGroup)
def main() -> None:
    """Tollgate: a multi-tenant, OpenAI-compatible LLM API platform."""
