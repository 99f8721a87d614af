"""TEST DOUBLE of Stripe's remote HTTP API (the one component of Tollgate that cannot run here).

A threaded HTTP server on 127.0.0.1 that speaks the small part of Stripe's v1 API Tollgate uses, so the
real ``stripe`` SDK (``TOLLGATE_STRIPE_API_BASE``) is driven end to end. It behaves like Stripe where
Tollgate's correctness depends on it:
- ``Idempotency-Key``: the first answer to a key is stored and replayed for every later request with
  the same key (``Idempotent-Replayed: true``); the same key with other parameters is a 400
  ``idempotency_error``.
- ``POST /v1/billing/meter_events`` rejects an ``identifier`` it has already accepted (400) and checks
  ``event_name`` against a created meter and ``payload[stripe_customer_id]`` against a customer.
- Faults on demand: ``fail_next(n, path)`` answers 500 to the next ``n`` matching requests without
  processing them; ``drop_after_processing(n, path)`` processes the next ``n`` matching requests, then
  closes the connection without answering (a client crash or network loss between Stripe accepting a
  request and the client recording it); ``hold_after_processing(n, path)`` processes them and keeps the
  client waiting for its answer until ``stop()`` (so a test can kill the client process while Stripe
  has the request and the client does not know). ``forget_idempotency_keys()`` ages out stored keys
  (Stripe keeps them 24 hours).

State is inspectable from the test: ``meter_events`` (accepted, in order), ``balance_transactions``,
``customers``, ``subscriptions``, ``meters``, ``products``, ``prices``, ``requests``.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit


def _nest(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """``payload[value]=1&items[0][price]=p`` → nested dicts/lists (Stripe's form encoding)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        parts = key.replace("]", "").split("[")
        node: Any = out
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                index = int(part)
                while len(node) <= index:
                    node.append({})
                if last:
                    node[index] = value
                else:
                    node = node[index]
                continue
            if last:
                node[part] = value
            else:
                nxt = parts[i + 1]
                node = node.setdefault(part, [] if nxt.isdigit() else {})
    return out


@dataclass
class _Fault:
    path: str
    remaining: int


@dataclass
class FakeStripe:
    """Start with ``start()``, stop with ``stop()``; ``url`` is the API base."""

    meter_events: list[dict[str, Any]] = field(default_factory=list)
    balance_transactions: list[dict[str, Any]] = field(default_factory=list)
    customers: dict[str, dict[str, Any]] = field(default_factory=dict)
    subscriptions: dict[str, dict[str, Any]] = field(default_factory=dict)
    meters: dict[str, dict[str, Any]] = field(default_factory=dict)
    products: dict[str, dict[str, Any]] = field(default_factory=dict)
    prices: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    rejected_identifiers: list[str] = field(default_factory=list)
    replays: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._idempotency: dict[str, tuple[str, int, bytes]] = {}
        self._identifiers: set[str] = set()
        self._failures: list[_Fault] = []
        self._drops: list[_Fault] = []
        self._holds: list[_Fault] = []
        self._released = threading.Event()
        self.holding = threading.Event()  # set once a held request has been processed
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ control
    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeStripe:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                fake._handle(self, "GET")

            def do_POST(self) -> None:
                fake._handle(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._released.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def fail_next(self, n: int, path: str = "/v1/billing/meter_events") -> None:
        with self._lock:
            self._failures.append(_Fault(path, n))

    def drop_after_processing(self, n: int, path: str = "/v1/billing/meter_events") -> None:
        with self._lock:
            self._drops.append(_Fault(path, n))

    def hold_after_processing(self, n: int, path: str = "/v1/billing/meter_events") -> None:
        with self._lock:
            self._holds.append(_Fault(path, n))

    def forget_idempotency_keys(self) -> None:
        with self._lock:
            self._idempotency.clear()

    def meter_total(self, customer: str) -> int:
        return sum(int(e["payload"]["value"]) for e in self.meter_events
                   if e["payload"]["stripe_customer_id"] == customer)

    # ------------------------------------------------------------------ HTTP
    def _take(self, faults: list[_Fault], path: str) -> bool:
        for fault in faults:
            if fault.remaining > 0 and path == fault.path:
                fault.remaining -= 1
                return True
        return False

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length).decode() if length else ""
        split = urlsplit(handler.path)
        path = split.path
        params = _nest(parse_qsl(body or split.query, keep_blank_values=True))
        key = handler.headers.get("Idempotency-Key")
        with self._lock:
            self.requests.append((method, path))
            if self._take(self._failures, path):
                return self._send(handler, 500, _error("api_error", "Simulated server error"))
            if method == "POST" and key and key in self._idempotency:
                stored_body, status, payload = self._idempotency[key]
                if stored_body != body:
                    return self._send(handler, 400, _error(
                        "idempotency_error", "Keys for idempotent requests can only be used with the same "
                        "parameters they were first used with."), replayed=False)
                return self._send(handler, status, payload, replayed=True)
            status, payload = self._route(method, path, params)
            encoded = json.dumps(payload).encode()
            if method == "POST" and key and status < 500:
                self._idempotency[key] = (body, status, encoded)
            if self._take(self._drops, path):
                handler.close_connection = True
                return None
            hold = self._take(self._holds, path)
        if hold:
            self.holding.set()
            self._released.wait()
            handler.close_connection = True
            return None
        return self._send(handler, status, encoded)

    def _send(self, handler: BaseHTTPRequestHandler, status: int, payload: bytes | dict[str, Any],
              replayed: bool = False) -> None:
        if replayed:
            self.replays += 1
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("Request-Id", f"req_{secrets.token_hex(6)}")
        if replayed:
            handler.send_header("Idempotent-Replayed", "true")
        handler.end_headers()
        handler.wfile.write(data)

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids):06d}{secrets.token_hex(4)}"

    def _route(self, method: str, path: str, p: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        now = int(time.time())
        if method == "GET" and path == "/v1/billing/meters":
            return 200, {"object": "list", "url": path, "has_more": False, "data": list(self.meters.values())}
        if method != "POST":
            return 404, _error("invalid_request_error", f"Unrecognized request URL ({method}: {path})")
        if path == "/v1/billing/meters":
            if any(m["event_name"] == p.get("event_name") and m["status"] == "active"
                   for m in self.meters.values()):
                return 400, _error("invalid_request_error",
                                   "An active meter with this event_name already exists.")
            meter = {"id": self._new_id("mtr"), "object": "billing.meter", "created": now, "status": "active",
                     "display_name": p.get("display_name"), "event_name": p.get("event_name"),
                     "default_aggregation": p.get("default_aggregation", {}),
                     "customer_mapping": p.get("customer_mapping", {}),
                     "value_settings": p.get("value_settings", {}), "livemode": False}
            self.meters[meter["id"]] = meter
            return 200, meter
        if path == "/v1/products":
            product = {"id": self._new_id("prod"), "object": "product", "name": p.get("name"), "created": now,
                       "active": True, "metadata": p.get("metadata", {})}
            self.products[product["id"]] = product
            return 200, product
        if path == "/v1/prices":
            recurring = p.get("recurring", {})
            if recurring.get("usage_type") == "metered" and recurring.get("meter") not in self.meters:
                return 400, _error("invalid_request_error", "No such meter", param="recurring[meter]")
            if p.get("product") not in self.products:
                return 400, _error("invalid_request_error", "No such product", param="product")
            price = {"id": self._new_id("price"), "object": "price", "product": p.get("product"),
                     "currency": p.get("currency"), "unit_amount_decimal": p.get("unit_amount_decimal"),
                     "recurring": recurring, "created": now, "active": True}
            self.prices[price["id"]] = price
            return 200, price
        if path == "/v1/customers":
            customer = {"id": self._new_id("cus"), "object": "customer", "name": p.get("name"),
                        "email": p.get("email"), "metadata": p.get("metadata", {}), "balance": 0,
                        "created": now}
            self.customers[customer["id"]] = customer
            return 200, customer
        if path.startswith("/v1/customers/") and path.endswith("/balance_transactions"):
            customer_id = path.split("/")[3]
            if customer_id not in self.customers:
                return 404, _error("invalid_request_error", f"No such customer: '{customer_id}'")
            amount = int(p["amount"])
            self.customers[customer_id]["balance"] += amount
            txn = {"id": self._new_id("cbtxn"), "object": "customer_balance_transaction", "amount": amount,
                   "currency": p.get("currency"), "customer": customer_id,
                   "description": p.get("description"), "metadata": p.get("metadata", {}),
                   "ending_balance": self.customers[customer_id]["balance"], "created": now,
                   "type": "adjustment"}
            self.balance_transactions.append(txn)
            return 200, txn
        if path == "/v1/subscriptions":
            if p.get("customer") not in self.customers:
                return 400, _error("invalid_request_error", "No such customer", param="customer")
            items = p.get("items", [])
            if not items or any(item.get("price") not in self.prices for item in items):
                return 400, _error("invalid_request_error", "No such price", param="items[0][price]")
            sub = {"id": self._new_id("sub"), "object": "subscription", "customer": p["customer"],
                   "status": "active", "created": now, "metadata": p.get("metadata", {}),
                   "items": {"object": "list", "data": [
                       {"id": self._new_id("si"), "object": "subscription_item",
                        "price": self.prices[i["price"]]} for i in items]}}
            self.subscriptions[sub["id"]] = sub
            return 200, sub
        if path == "/v1/billing/meter_events":
            return self._meter_event(p, now)
        return 404, _error("invalid_request_error", f"Unrecognized request URL (POST: {path})")

    def _meter_event(self, p: dict[str, Any], now: int) -> tuple[int, dict[str, Any]]:
        payload = p.get("payload", {})
        if not any(m["event_name"] == p.get("event_name") for m in self.meters.values()):
            return 400, _error("invalid_request_error", "No active meter for event_name", param="event_name")
        if payload.get("stripe_customer_id") not in self.customers:
            return 400, _error("invalid_request_error", "No such customer",
                               param="payload[stripe_customer_id]")
        try:
            value = int(payload.get("value", ""))
        except ValueError:
            return 400, _error("invalid_request_error", "value must be an integer", param="payload[value]")
        identifier = p.get("identifier") or self._new_id("evt")
        if identifier in self._identifiers:
            self.rejected_identifiers.append(identifier)
            return 400, _error("invalid_request_error",
                               f"An event already exists with identifier {identifier}.",
                               code="resource_already_exists", param="identifier")
        timestamp = int(p.get("timestamp") or now)
        if timestamp < now - 35 * 86400 or timestamp > now + 300:
            return 400, _error("invalid_request_error", "Timestamp out of range", param="timestamp")
        self._identifiers.add(identifier)
        event = {"object": "billing.meter_event", "created": now, "event_name": p["event_name"],
                 "identifier": identifier, "livemode": False, "timestamp": timestamp,
                 "payload": {"stripe_customer_id": payload["stripe_customer_id"], "value": str(value)}}
        self.meter_events.append(event)
        return 200, event


def _error(type_: str, message: str, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"type": type_, "message": message}
    if code:
        error["code"] = code
    if param:
        error["param"] = param
    return {"error": error}


def sign_webhook(payload: bytes, secret: str, timestamp: int | None = None) -> str:
    """A ``Stripe-Signature`` header for ``payload``, computed the way Stripe signs webhooks."""
    t = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{t}.".encode() + payload, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"
