"""Alembic entry points used by ``tollgate migrate``, ``tollgate up`` and the tests.

Invariants:
- The migration scripts are found through the installed ``migrations`` package, so these functions work
  from any working directory (``alembic.ini`` at the repository root is only for the ``alembic`` CLI).
- The URL given here wins over the settings; ``migrations/env.py`` falls back to
  ``TOLLGATE_DATABASE_URL``.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

import migrations
from tollgate.db import to_psycopg_url

SCRIPT_LOCATION = Path(migrations.__file__).resolve().parent


def alembic_config(url: str | None = None) -> Config:
    """An Alembic config pointing at this project's migrations (and at ``url`` when given)."""
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    config.set_main_option("file_template",
                           "%%(year)d%%(month).2d%%(day).2d_%%(hour).2d%%(minute).2d_%%(rev)s_%%(slug)s")
    if url is not None:
        # Alembic interpolates the value: a password with '%' must be doubled.
        config.set_main_option("sqlalchemy.url", to_psycopg_url(url).replace("%", "%%"))
    return config


def upgrade(url: str | None = None, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | None = None, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)
