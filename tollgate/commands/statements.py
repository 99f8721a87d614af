"""``tollgate statements TENANT --month YYYY-MM [--format table|json|csv]``: a tenant's monthly statement.

Line items by model, class and token kind, exact in pico-USD, shown in cents with the rounding carried to
the total (``billing.statements``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

    from billing.statements import Statement


@click.command()
@click.argument("tenant")
@click.option("--month", required=True, help="UTC month, YYYY-MM.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table",
              show_default=True)
def statements(tenant: str, month: str, fmt: str) -> None:
    """Print TENANT's (name or id) statement for --month."""
    import orjson

    from billing.statements import StatementTenantNotFound, build_statement, find_tenant_id, format_cents
    from tollgate.commands._async import run_in_session
    from tollgate.settings import get_settings

    async def work(session: AsyncSession) -> Statement:
        try:
            return await build_statement(session, await find_tenant_id(session, tenant), month)
        except (StatementTenantNotFound, ValueError) as exc:
            raise click.ClickException(str(exc)) from exc

    statement = run_in_session(get_settings(), work)
    if fmt == "json":
        click.echo(orjson.dumps(statement.as_dict(), option=orjson.OPT_INDENT_2).decode())
        return
    if fmt == "csv":
        click.echo(statement.to_csv(), nl=False)
        return
    click.echo(f"Statement {statement.month} for {statement.tenant_name} (tenant {statement.tenant_id}), "
               f"{statement.requests} requests")
    click.echo(f"{'model':<24} {'class':<12} {'kind':<14} {'tokens':>14} {'amount (USD)':>14}")
    for line in statement.lines:
        click.echo(f"{line.model:<24} {line.request_class:<12} {line.token_kind:<14} {line.tokens:>14} "
                   f"{format_cents(line.amount_cents):>14}")
    click.echo(f"{'total':<66} {format_cents(statement.total_cents):>14}")
    click.echo(f"exact total: {statement.total_pico_usd} pico-USD")
    details = statement.detail_totals()
    if any(details.values()):
        click.echo("of the output: " + ", ".join(f"{name} {count}" for name, count in details.items()))
