"""``tollgate batches watch ID`` and ``tollgate batches show ID``: an operator's view of one batch, read
straight from Postgres (``TOLLGATE_DATABASE_URL``), whoever owns it.

``watch`` draws a progress bar of answered lines (completed + failed out of total) from the live
``request_counts`` (redrawn in place on a terminal, one line per change when piped), polling every
``--interval`` seconds until the batch reaches a final status, then prints the summary and exits 0
(``completed``) or 1 (any other final status).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import click

from tollgate.settings import get_settings

FINAL = ("failed", "completed", "expired", "cancelled")
BAR_WIDTH = 40


async def _fetch(db: Any, batch_id: str) -> Any:
    from tollgate.models import Batch

    async with db.session() as session:
        return await session.get(Batch, batch_id)


def _summary(batch: Any) -> str:
    parts = [f"batch {batch.id}: {batch.status}", f"{batch.request_completed} completed",
             f"{batch.request_failed} failed", f"of {batch.request_total}",
             f"tokens in/out {batch.prompt_tokens}/{batch.completion_tokens}",
             f"cost ${batch.cost_pico_usd / 1e12:.6f}"]
    if batch.output_file_id:
        parts.append(f"output {batch.output_file_id}")
    if batch.error_file_id:
        parts.append(f"errors {batch.error_file_id}")
    errors = [f"  line {e.get('line')}: {e.get('code')}: {e.get('message')}" for e in batch.errors or []]
    return "\n".join([", ".join(parts), *errors])


def progress_line(batch: Any, width: int = BAR_WIDTH) -> str:
    """``[#########...........]  90/200  45% in_progress`` (answered lines: completed + failed)."""
    done = batch.request_completed + batch.request_failed
    total = batch.request_total
    filled = width * done // total if total else 0
    percent = f"{100 * done // total:3d}%" if total else "  -%"
    bar = "#" * filled + "." * (width - filled)
    return f"[{bar}] {done:>{len(str(total))}}/{total} {percent} {batch.status}"


def _draw(line: str) -> None:
    """Redraw in place on a terminal; one line per change otherwise (logs, pipes)."""
    if sys.stdout.isatty():
        click.echo("\r" + line, nl=False)
    else:
        click.echo(line)


def _run(batch_id: str, watch: bool, interval: float) -> int:
    from tollgate.db import Database

    async def main() -> int:
        db = Database.from_settings(get_settings())
        try:
            batch = await _fetch(db, batch_id)
            if batch is None:
                raise click.ClickException(f"no batch {batch_id}")
            if watch:
                shown = None
                while True:
                    line = progress_line(batch)
                    if line != shown:
                        _draw(line)
                        shown = line
                    if batch.status in FINAL:
                        break
                    await asyncio.sleep(interval)
                    batch = await _fetch(db, batch_id)
                if sys.stdout.isatty():
                    click.echo()
            click.echo(_summary(batch))
            return 1 if batch.status in FINAL and batch.status != "completed" else 0
        finally:
            await db.dispose()

    started = time.monotonic()
    code = asyncio.run(main())
    if watch:
        click.echo(f"watched for {time.monotonic() - started:.1f} s", err=True)
    return code


@click.group()
def batches() -> None:
    """Inspect batches (the Batch API's work) from the database."""


@batches.command("watch")
@click.argument("batch_id")
@click.option("--interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between polls.")
def watch(batch_id: str, interval: float) -> None:
    """Show a progress bar until BATCH_ID is final."""
    raise SystemExit(_run(batch_id, True, interval))


@batches.command("show")
@click.argument("batch_id")
def show(batch_id: str) -> None:
    """Print BATCH_ID's status, counts, usage and files."""
    raise SystemExit(_run(batch_id, False, 1.0))
