"""``tollgate migrate``: bring the database schema to a revision (Alembic; head by default)."""

from __future__ import annotations

import click


@click.command()
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@click.option("--downgrade", is_flag=True, help="Go down to --revision (e.g. base) instead of up.")
def migrate(revision: str, downgrade: bool) -> None:
    """Apply the Alembic migrations to TOLLGATE_DATABASE_URL."""
    from tollgate import schema
    from tollgate.db import database_url
    from tollgate.settings import get_settings

    try:
        url = database_url(get_settings())
    except RuntimeError as e:
        raise click.ClickException(str(e)) from e
    if downgrade:
        schema.downgrade(url, revision)
    else:
        schema.upgrade(url, revision)
    click.echo(f"database schema {'downgraded' if downgrade else 'upgraded'} to {revision}")
