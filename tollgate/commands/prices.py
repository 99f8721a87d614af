"""``tollgate prices set|list``: the price book, in USD per million tokens on the command line and whole
pico-USD per token in the database (exact ``Decimal`` conversion; a price that is not a whole number of
pico-USD per token is refused, never rounded).

Defaults for the optional prices: cached input = 10% of input, embedding input (what ``/v1/embeddings``
charges per prompt token) = input, the prompt-cache products (``--cache-write``, ``--cache-pin``,
``--cache-retention``: charged on top of the input prices per prompt token written to the prefix cache,
pinned for ``prompt_cache_options.ttl``, retained for ``prompt_cache_retention``) = 0, batch = half of
the synchronous price (rounded down to whole pico-USD). One option per
``billing.prices.OPTIONAL_PRICE_FIELDS`` name. A row that has taken effect is never rewritten; add a new
one with a later ``--effective-from``. ``--effective-from`` in the past is refused (exit code 2), as the
admin API refuses it (``billing.prices.new_price_start``): a backdated row would reprice requests
already billed.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import click


def _pico(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    from billing.prices import usd_per_mtok_to_pico

    try:
        return usd_per_mtok_to_pico(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def _when(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"not an ISO 8601 date/time: {value!r}", ctx=ctx, param=param) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@click.group()
def prices() -> None:
    """Per-model token prices (USD per million tokens)."""


@prices.command("set")
@click.argument("model")
@click.option("--input", "input_", required=True, callback=_pico, help="USD per 1M input tokens.")
@click.option("--output", required=True, callback=_pico, help="USD per 1M output tokens.")
@click.option("--cached-input", callback=_pico, help="USD per 1M cached input tokens [10% of --input].")
@click.option("--batch-input", callback=_pico, help="[half of --input]")
@click.option("--batch-cached-input", callback=_pico, help="[half of the cached input price]")
@click.option("--batch-output", callback=_pico, help="[half of --output]")
@click.option("--embedding-input", callback=_pico,
              help="USD per 1M /v1/embeddings input tokens, cached or not [--input].")
@click.option("--batch-embedding-input", callback=_pico, help="[half of the embedding input price]")
@click.option("--cache-write", callback=_pico,
              help="USD per 1M prompt tokens written to the prompt cache, on top of input [0].")
@click.option("--cache-pin", callback=_pico,
              help="USD per 1M prompt tokens pinned for prompt_cache_options.ttl, on top of input [0].")
@click.option("--cache-retention", callback=_pico,
              help="USD per 1M prompt tokens retained for prompt_cache_retention 24h, on top of input [0].")
@click.option("--batch-cache-write", callback=_pico, help="[half of the cache write price]")
@click.option("--batch-cache-pin", callback=_pico, help="[half of the cache pin price]")
@click.option("--batch-cache-retention", callback=_pico, help="[half of the cache retention price]")
@click.option("--effective-from", callback=_when,
              help="ISO 8601 start (UTC if no offset), at least 15 s ahead, once every gateway has "
                   "loaded it [in 15 s].")
def set_price(model: str, input_: int, output: int, effective_from: datetime | None,
              **optional: int | None) -> None:
    """Set MODEL's price from --effective-from on."""
    from billing.prices import PastEffectiveFrom, Price, new_price_start
    from billing.service import PriceConflict

    try:
        effective_from = new_price_start(effective_from)
    except PastEffectiveFrom as exc:
        raise click.BadParameter(
            f"{exc.effective_from.isoformat()} is in the past (now {exc.now.isoformat(timespec='seconds')}): "
            "a price row takes effect later, never retroactively (gateways have already billed "
            "by the row in effect). Omit --effective-from to start as soon as every gateway has it.",
            param_hint="'--effective-from'") from None
    except ValueError as exc:  # too soon, too far ahead, or no timezone
        raise click.BadParameter(str(exc), param_hint="'--effective-from'") from None
    price = Price.of(input=input_, output=output, **optional)
    try:
        start = asyncio.run(_set(model, price, effective_from))
    except PriceConflict as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(f"{model} from {start.isoformat()}: {_describe(price)}")


@prices.command("list")
@click.argument("model", required=False)
def list_prices(model: str | None) -> None:
    """Show the price rows (of MODEL, or of every model)."""
    rows = asyncio.run(_list(model))
    if not rows:
        click.echo("no prices" + (f" for {model}" if model else ""))
    for name, start, price in rows:
        click.echo(f"{name}\t{start.isoformat()}\t{_describe(price)}")


def _describe(price: object) -> str:
    from billing.prices import PRICE_FIELDS, pico_to_usd_per_mtok

    usd = {name: format(pico_to_usd_per_mtok(getattr(price, name)), "f") for name in PRICE_FIELDS}
    return " ".join(f"{name}=${value}/Mtok" for name, value in usd.items())


async def _set(model: str, price: object, effective_from: datetime | None) -> datetime:
    from billing.service import set_price as set_price_row
    from gateway.admin.service import record_price_set
    from tollgate.commands._async import cli_actor
    from tollgate.db import Database
    from tollgate.settings import get_settings

    db = Database.from_settings(get_settings())
    try:
        async with db.session() as session:
            start = await set_price_row(session, model, price, effective_from)  # type: ignore[arg-type]
            # Recorded like the admin API's price.set, in the same unit of work.
            await record_price_set(session, cli_actor(), model, start, price)  # type: ignore[arg-type]
            return start
    finally:
        await db.dispose()


async def _list(model: str | None) -> list:
    from billing import repository
    from tollgate.db import Database
    from tollgate.settings import get_settings

    db = Database.from_settings(get_settings())
    try:
        async with db.session() as session:
            if model:
                return [(model, start, price) for start, price in await repository.price_rows(session, model)]
            return await repository.all_prices(session)
    finally:
        await db.dispose()
