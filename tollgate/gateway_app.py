"""The gateway process's application: its extensions, and the order that matters, in one place.

``tollgate gateway`` serves ``uvicorn --factory tollgate.gateway_app:create_app``. This module is part of
the composition root, above every layer, so it names the dashboard and billing's webhooks directly
(the gateway may not import them). What an extension's position decides is stated in ``gateway.app``;
here, why each extension is where it is (``tests/tollgate/test_gateway_app.py`` holds these):

1. ``gateway.health``: ``/health``, no middleware of its own.
2. ``gateway.api``: the OpenAI API. Its lifespan starts and stops the ``GatewayRuntime`` (engine
   clients, admission, the usage outbox); its ``RequestContextMiddleware`` gives every request its id
   and body limits, and its exception handlers write OpenAI's error body.
3. ``gateway.metrics``, after ``gateway.api``, for the drain: its lifespan, exited *before* api's, waits
   until every in-flight request has settled and metered (bounded by ``drain_timeout_s``) while the
   runtime those requests need is still up. Its middleware, installed after api's, is the outermost:
   it counts and times every request, errors included, and holds a stream in flight until its last
   byte.
4. Files, batches, the admin API, usage and statements, billing's Stripe webhooks: routes under their
   own prefixes; their relative order does not matter. (``gateway.admin``'s exception handlers are
   the same as api's.)
5. ``admin_ui.extension`` last: its router ends with the dashboard's ``/admin/{path}`` catch-all,
   which would answer for any ``/admin`` route included after it.
"""

from __future__ import annotations

from types import ModuleType

from fastapi import FastAPI

import admin_ui.extension
import billing.webhooks
import gateway.admin
import gateway.api
import gateway.batches.endpoints
import gateway.files.endpoints
import gateway.health
import gateway.metrics
import gateway.usage
from gateway import app as gateway_app
from tollgate.settings import Settings

EXTENSIONS: tuple[ModuleType, ...] = (
    gateway.health,
    gateway.api,
    gateway.metrics,
    gateway.files.endpoints,
    gateway.batches.endpoints,
    gateway.admin,
    gateway.usage,
    billing.webhooks,
    admin_ui.extension,
)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The gateway process's app: every extension, in the order above."""
    return gateway_app.create_app(settings, EXTENSIONS)
