"""Usage and statements as a ``gateway.app`` extension module (``router``):

- ``/v1/organization/usage/completions`` and ``/v1/organization/costs``: tenants read their own usage
  and costs with their API key, in the shape of OpenAI's Usage and Costs APIs (``endpoints.py``).
- ``/admin/v1/statements/{tenant}[.csv]?month=YYYY-MM``: monthly statements for admins
  (``admin_statements.py``), behind the admin API's token check.

Errors render in OpenAI's body through the handlers that ``gateway.api`` / ``gateway.admin`` install.
"""

from __future__ import annotations

from fastapi import APIRouter

from gateway.usage.admin_statements import router as admin_statements_router
from gateway.usage.endpoints import router as usage_router

router = APIRouter()
router.include_router(usage_router)
router.include_router(admin_statements_router)

__all__ = ["router"]
