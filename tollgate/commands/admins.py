"""``tollgate admins create|rotate-token|set-password|delete|list``: admins of the admin API and dashboard.

``create EMAIL`` adds a row to ``admins`` and prints its admin API token as the LAST line of its output
(scripts take ``| tail -n 1``); the token is stored only as an HMAC-SHA256 hash and shown only once.
The dashboard password comes from ``TOLLGATE_ADMIN_PASSWORD``, else from a hidden prompt (on a terminal,
or with ``--prompt-password``); only its argon2 hash is stored. It is never taken as an argument: a
password on the command line would land in shell history.
``rotate-token EMAIL`` replaces a lost or leaked token the same way. ``set-password EMAIL`` sets the
dashboard password (read as by ``create``; ``--remove`` leaves a token-only admin) and ends that admin's
dashboard sessions; ``delete EMAIL`` removes an admin (its token and sessions stop working). Each change
is recorded in ``audit_log`` with the actor ``cli:<user>``, in the same unit of work.
"""

from __future__ import annotations

import os
import sys

import click

from tollgate.commands._async import cli_actor, run_in_session
from tollgate.settings import get_settings

PASSWORD_ENV = "TOLLGATE_ADMIN_PASSWORD"


@click.group()
def admins() -> None:
    """Admins of the admin API and the dashboard."""


def _dashboard_password(prompt: bool | None) -> str | None:
    """The password from ``TOLLGATE_ADMIN_PASSWORD``, else asked for (twice, hidden) when ``prompt`` is
    set or, left unset, when standard input is a terminal; ``None`` makes a token-only admin."""
    password = os.environ.get(PASSWORD_ENV)
    if password:
        return password
    if prompt is None:
        prompt = sys.stdin.isatty()
    if not prompt:
        return None
    return click.prompt("Dashboard password", hide_input=True, confirmation_prompt=True, err=True)


@admins.command("create")
@click.argument("email")
@click.option("--prompt-password/--no-prompt-password", "prompt", default=None,
              help=f"Ask for the dashboard password when {PASSWORD_ENV} is unset "
                   "(default: only on a terminal).")
def create_admin(email: str, prompt: bool | None) -> None:
    """Create admin EMAIL; its admin API token is the last line printed (shown only once)."""
    from gateway.admin import service

    password = _dashboard_password(prompt)
    settings = get_settings()
    admin, token = run_in_session(settings, lambda s: service.create_admin(
        s, email, settings=settings, actor=cli_actor(), password=password or None))
    login = " and dashboard password" if password else ""
    click.echo(f"created admin {admin.id} {admin.email!r}{login}; its admin API token is shown only once:")
    click.echo(token)


@admins.command("rotate-token")
@click.argument("email")
def rotate_token(email: str) -> None:
    """Replace EMAIL's admin API token (the old one stops working); the new one is the last line."""
    from gateway.admin import service

    settings = get_settings()
    admin, token = run_in_session(
        settings, lambda s: service.rotate_admin_token(s, email, settings=settings, actor=cli_actor()))
    click.echo(f"new admin API token for {admin.email!r}; it is shown only once:")
    click.echo(token)


@admins.command("set-password")
@click.argument("email")
@click.option("--remove", is_flag=True, help="Remove the dashboard password (the admin keeps its token).")
def set_password(email: str, remove: bool) -> None:
    """Set EMAIL's dashboard password (from TOLLGATE_ADMIN_PASSWORD, else asked for); its sessions end."""
    from gateway.admin import service

    password = None if remove else _dashboard_password(True)
    settings = get_settings()
    admin = run_in_session(settings, lambda s: service.set_admin_password(s, email, password,
                                                                           actor=cli_actor()))
    click.echo(f"dashboard password of {admin.email!r} {'removed' if remove else 'set'}; "
               "its dashboard sessions have ended")


@admins.command("delete")
@click.argument("email")
@click.confirmation_option(prompt="Delete this admin? Its token and dashboard sessions stop working.")
def delete_admin(email: str) -> None:
    """Delete admin EMAIL: its API token and dashboard sessions stop working at once."""
    from gateway.admin import service

    admin = run_in_session(get_settings(), lambda s: service.delete_admin(s, email, actor=cli_actor()))
    click.echo(f"deleted admin {admin.id} {admin.email!r}")


@admins.command("list")
def list_admins() -> None:
    """List admins (never their tokens or password hashes)."""
    from gateway.admin import service

    for admin in run_in_session(get_settings(), service.list_admins):
        login = "password" if admin.password_hash else "token only"
        click.echo(f"{admin.id}\t{admin.email}\t{login}\tcreated {admin.created_at.isoformat()}")
