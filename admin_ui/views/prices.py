"""The price book (every row with its effective dates, the one in effect marked) and adding a row.

Rows are added with ``gateway.admin.service.add_price`` (audit log, never in the past, conflicts
refused), the admin API's code. Prices are entered in USD per million tokens; omitted optional prices
(``billing.prices.OPTIONAL_PRICE_FIELDS``) take the platform defaults (cached input 10% of input,
embedding input the input price, the prompt-cache products 0, batch half).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import Response

from admin_ui.session import CurrentAdmin, check_csrf
from admin_ui.views.tenants import form_errors
from admin_ui.web import redirect, render, unit_of_work
from billing.prices import OPTIONAL_PRICE_FIELDS
from gateway.admin import service
from gateway.admin.auth import AdminPrincipal
from gateway.admin.schemas import PRICE_FIELDS, PriceCreateRequest
from gateway.errors import GatewayError

router = APIRouter(prefix="/admin/prices")


async def _page(request: Request, admin: AdminPrincipal, *, form: dict[str, Any] | None = None,
                errors: list[str] | None = None, notice: str | None = None, code: int = 200) -> Response:
    async with request.app.state.db.session() as session:
        rows = await service.list_prices(session)
    return render(request, "prices.html", {
        "title": "Prices", "rows": rows, "fields": PRICE_FIELDS, "form": form or {}, "errors": errors or [],
        "notice": notice,
    }, admin=admin, status=code)


@router.get("", include_in_schema=False)
async def prices(request: Request, admin: CurrentAdmin, done: str | None = None) -> Response:
    return await _page(request, admin, notice="Price added." if done == "added" else None)


@router.post("", include_in_schema=False)
async def add_price(request: Request, admin: CurrentAdmin) -> Response:
    fields = await check_csrf(request)
    raw: dict[str, Any] = {"model": fields.get("model", ""),
                           "input_usd_per_mtok": fields.get("input", "").strip(),
                           "output_usd_per_mtok": fields.get("output", "").strip()}
    for name in OPTIONAL_PRICE_FIELDS:
        if fields.get(name, "").strip():
            raw[f"{name}_usd_per_mtok"] = fields[name].strip()
    try:
        effective = fields.get("effective_from", "").strip()
        if effective:
            raw["effective_from"] = datetime.fromisoformat(effective).replace(tzinfo=UTC)
        body = PriceCreateRequest.model_validate(raw)
        async with unit_of_work(request) as session:
            await service.add_price(session, body, actor=admin.actor)
    except ValidationError as exc:
        return await _page(request, admin, form=fields, errors=form_errors(exc), code=400)
    except ValueError as exc:
        return await _page(request, admin, form=fields, errors=[f"effective from: {exc}"], code=400)
    except GatewayError as exc:
        return await _page(request, admin, form=fields, errors=[exc.message], code=exc.status)
    return redirect(request, "/admin/prices", done="added")
