"""Price book and cost: integer pico-USD (1e-12 USD) per token, exact arithmetic only.

Invariants:
- A ``Price`` holds fourteen non-negative integer per-token prices (``PRICE_FIELDS``): ``input``,
  ``cached_input``, ``output``, their batch counterparts, ``embedding_input`` with its batch
  counterpart, and the prompt-cache products ``cache_write``, ``cache_pin``, ``cache_retention`` with
  theirs. ``Price.of`` fills the optional ones with the platform defaults: cached input = 10% of
  input, embedding input = input, the cache products 0 (OpenAI charges nothing extra for them by
  default), batch = half of the synchronous price, each rounded down to whole pico-USD (a default never
  charges more than the stated discount).
- ``cost_pico_usd`` is exact: cached prompt tokens at the cached price, the rest of the prompt at the
  input price, completion tokens at the output price; the batch prices for ``request_class="batch"``.
- The cache products are charged on top of that, per prompt token they apply to
  (``CACHE_TOKEN_FIELDS``): ``cache_write_tokens`` (newly written to the prefix cache) at
  ``cache_write``, ``cache_pinned_tokens`` (pinned in host memory for ``prompt_cache_options.ttl``) at
  ``cache_pin``, ``cache_retained_tokens`` (kept on disk for ``prompt_cache_retention: "24h"``) at
  ``cache_retention``. Each count is 0..``prompt_tokens``; anything else is refused.
- An embedding request (``embedding=True``: ``/v1/embeddings``, and batch lines targeting it) generates
  nothing: it costs every prompt token at the (batch) embedding input price, cached or not (no cached
  discount, as OpenAI prices embeddings); a completion or cache token count other than 0 is refused.
- ``max_cost_pico_usd`` (what admission holds) is never below the cost of any usage the request can
  report: every prompt token at the dearer of input and cached, also at ``cache_write``, and at
  ``cache_pin`` / ``cache_retention`` when the request asked for a pin / a retention.
- A model has no price until a ``prices`` row says so. There is deliberately no fallback price:
  ``PriceBook.price_for`` raises ``PriceNotFound`` and the gateway refuses to serve an unpriced model
  rather than serve it for free. ``tollgate up`` seeds a row for the tiny demo model
  (``billing.service.ensure_price``); operators set real ones with ``tollgate prices set``.
- Effective dates: a row applies from its ``effective_from`` until the next row of the same model;
  a request is priced by the row in effect when it was admitted.
- ``$/Mtok → pico-USD/token`` is ``× 1,000,000`` in ``Decimal``; a price that is not a whole number of
  pico-USD per token is refused, never rounded.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from engine.usage import KINDS, PRICED_KINDS, SURCHARGE_KINDS, TokenKind, Usage, cost_field
from tollgate.models import LATEST_TIME

RequestClass = Literal["interactive", "batch"]
REQUEST_CLASSES: tuple[str, ...] = ("interactive", "batch")
PICO_PER_TOKEN_PER_USD_PER_MTOK = 1_000_000  # 1 USD / 1e6 tokens = 1e12 pico-USD / 1e6 tokens


class PriceNotFound(LookupError):
    """No price row covers this model at this time: the model must not be served."""


@dataclass(frozen=True, slots=True)
class Price:
    input: int
    cached_input: int
    output: int
    batch_input: int
    batch_cached_input: int
    batch_output: int
    embedding_input: int
    batch_embedding_input: int
    cache_write: int
    cache_pin: int
    cache_retention: int
    batch_cache_write: int
    batch_cache_pin: int
    batch_cache_retention: int

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"price {name} must be a non-negative integer pico-USD, got {value!r}")

    @classmethod
    def of(cls, *, input: int, output: int, cached_input: int | None = None, batch_input: int | None = None,
           batch_cached_input: int | None = None, batch_output: int | None = None,
           embedding_input: int | None = None, batch_embedding_input: int | None = None,
           cache_write: int | None = None, cache_pin: int | None = None, cache_retention: int | None = None,
           batch_cache_write: int | None = None, batch_cache_pin: int | None = None,
           batch_cache_retention: int | None = None) -> Price:
        """A price with the defaults filled in (cached = input // 10, embedding = input, cache products 0,
        batch = synchronous // 2)."""
        cached = input // 10 if cached_input is None else cached_input
        embedding = input if embedding_input is None else embedding_input
        write = 0 if cache_write is None else cache_write
        pin = 0 if cache_pin is None else cache_pin
        retention = 0 if cache_retention is None else cache_retention
        return cls(
            input=input,
            cached_input=cached,
            output=output,
            batch_input=input // 2 if batch_input is None else batch_input,
            batch_cached_input=cached // 2 if batch_cached_input is None else batch_cached_input,
            batch_output=output // 2 if batch_output is None else batch_output,
            embedding_input=embedding,
            batch_embedding_input=embedding // 2 if batch_embedding_input is None else batch_embedding_input,
            cache_write=write,
            cache_pin=pin,
            cache_retention=retention,
            batch_cache_write=write // 2 if batch_cache_write is None else batch_cache_write,
            batch_cache_pin=pin // 2 if batch_cache_pin is None else batch_cache_pin,
            batch_cache_retention=retention // 2 if batch_cache_retention is None else batch_cache_retention,
        )

    def for_class(self, request_class: str) -> tuple[int, int, int]:
        """(input, cached_input, output) per-token prices for ``request_class``."""
        if _is_batch(request_class):
            return self.batch_input, self.batch_cached_input, self.batch_output
        return self.input, self.cached_input, self.output

    def embedding_for_class(self, request_class: str) -> int:
        """The per-token price of an embedding request's prompt for ``request_class``."""
        return self.batch_embedding_input if _is_batch(request_class) else self.embedding_input

    def cache_for_class(self, request_class: str) -> tuple[int, int, int]:
        """(cache_write, cache_pin, cache_retention) per-token prices for ``request_class``."""
        if _is_batch(request_class):
            return self.batch_cache_write, self.batch_cache_pin, self.batch_cache_retention
        return self.cache_write, self.cache_pin, self.cache_retention


PRICE_FIELDS: tuple[str, ...] = tuple(column.name for column in fields(Price))
# Prices a new row may omit (``Price.of`` fills them with the defaults).
OPTIONAL_PRICE_FIELDS: tuple[str, ...] = tuple(n for n in PRICE_FIELDS if n not in ("input", "output"))
# The usage counts the cache products are charged on, in the order of ``Price.cache_for_class``.
CACHE_TOKEN_FIELDS: tuple[str, ...] = tuple(KINDS[k].field for k in SURCHARGE_KINDS)


def _is_batch(request_class: str) -> bool:
    if request_class not in REQUEST_CLASSES:
        raise ValueError(f"request_class must be one of {REQUEST_CLASSES}, got {request_class!r}")
    return request_class == "batch"


def per_token(price: Price, kind: TokenKind, request_class: str) -> int:
    """The per-token price of a priced ``kind`` for ``request_class``."""
    name = KINDS[kind].price
    if name is None:
        raise ValueError(f"{kind} is not priced")
    return getattr(price, f"batch_{name}" if _is_batch(request_class) else name)


@dataclass(frozen=True, slots=True)
class Charge:
    """What one request costs, per priced kind (``engine.usage.PRICED_KINDS``), in pico-USD."""

    costs: Mapping[TokenKind, int]

    @property
    def total(self) -> int:
        return sum(self.costs.values())

    def fields(self) -> dict[str, int]:
        """The ledger's cost columns (``engine.usage.COST_FIELDS``)."""
        return {cost_field(k): self.costs.get(k, 0) for k in PRICED_KINDS}

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> Charge:
        return cls({k: int(data.get(cost_field(k)) or 0) for k in PRICED_KINDS})


def charge(usage: Usage, price: Price, request_class: str, *, embedding: bool = False) -> Charge:
    """Price one request's usage, once, when it is metered: each priced kind's billed tokens
    (``Usage.billed``) at its price for ``request_class``. An ``embedding`` request costs its whole prompt
    at the embedding input price, cached tokens included; it has no output and no cache products."""
    usage.check()
    if embedding:
        if usage.completion_tokens:
            raise ValueError(f"an embedding request has no completion tokens, got {usage.completion_tokens}")
        if any(usage[k] for k in SURCHARGE_KINDS):
            raise ValueError("an embedding request has no cache products")
        costs = dict.fromkeys(PRICED_KINDS, 0)
        costs[TokenKind.INPUT] = usage.prompt_tokens * price.embedding_for_class(request_class)
        return Charge(costs)
    return Charge({k: n * per_token(price, k, request_class) for k, n in usage.billed().items()})


def cost_pico_usd(price: Price, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                  request_class: str, *, embedding: bool = False, cache_write_tokens: int = 0,
                  cache_pinned_tokens: int = 0, cache_retained_tokens: int = 0) -> int:
    """``charge(...).total`` of the usage these counts make (for callers holding counts, not a ``Usage``)."""
    usage = Usage.of(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                     completion_tokens=completion_tokens, cache_write_tokens=cache_write_tokens,
                     cache_pinned_tokens=cache_pinned_tokens, cache_retained_tokens=cache_retained_tokens)
    return charge(usage, price, request_class, embedding=embedding).total


def max_cost_pico_usd(price: Price, prompt_tokens: int, max_completion_tokens: int,
                      request_class: str, *, embedding: bool = False, cache_pin: bool = False,
                      cache_retention: bool = False) -> int:
    """The most a request can cost (what admission holds against the monthly budget): every prompt token
    at the dearer of the input and cached prices plus the cache write price (plus the pin and retention
    prices when the request asked for them), every allowed completion token at the output price; for an
    ``embedding`` request (``max_completion_tokens`` 0, no cache products), exactly its cost."""
    if prompt_tokens < 0 or max_completion_tokens < 0:
        raise ValueError("token counts must be >= 0")
    if embedding:
        return charge(Usage.of(prompt_tokens=prompt_tokens, completion_tokens=max_completion_tokens), price,
                      request_class, embedding=True).total
    input_price, cached_price, output_price = price.for_class(request_class)
    write_price, pin_price, retention_price = price.cache_for_class(request_class)
    per_prompt_token = (max(input_price, cached_price) + write_price + (pin_price if cache_pin else 0)
                        + (retention_price if cache_retention else 0))
    return prompt_tokens * per_prompt_token + max_completion_tokens * output_price


def usd_per_mtok_to_pico(value: str | int | Decimal) -> int:
    """``"3"`` ($3 per million tokens) → ``3_000_000`` pico-USD per token; ``"0.0000001"`` is refused
    (0.1 pico-USD per token is not representable)."""
    try:
        amount = Decimal(str(value).strip())
    except InvalidOperation:
        raise ValueError(f"not a number: {value!r}") from None
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"price must be a finite non-negative number, got {value!r}")
    pico = amount * PICO_PER_TOKEN_PER_USD_PER_MTOK
    if pico != pico.to_integral_value():
        raise ValueError(f"${value}/Mtok is not a whole number of pico-USD per token ({pico}); "
                         "use at most 6 decimal places")
    return int(pico)


class PastEffectiveFrom(ValueError):
    """A new price row may not start in the past: gateways refresh their price book every few seconds
    and have already priced (and billed) requests by the row then in effect, so a backdated row would
    race that refresh and rewrite the history the ledger was charged by."""

    def __init__(self, effective_from: datetime, now: datetime) -> None:
        super().__init__("effective_from must not be in the past (omit it to start as soon as it can)")
        self.effective_from = effective_from
        self.now = now


# How far ahead a new price row starts at the earliest. Gateways reload their price book every 10 s
# (``gateway.deps.PRICE_REFRESH_INTERVAL_S``): a row starting sooner would be in effect before some
# gateway had it, which would price the requests arriving meanwhile by the old row, while the ledger's
# rollups and statements price them by the new one. Omitted, a row starts this far ahead.
PRICE_LEAD = timedelta(seconds=15)


def new_price_start(effective_from: datetime | None, now: datetime | None = None) -> datetime:
    """Where a new price row starts: ``effective_from``, or ``now + PRICE_LEAD`` when omitted. Raises
    ``PastEffectiveFrom`` when it is before ``now``, and ``ValueError`` when it is sooner than
    ``PRICE_LEAD`` ahead, from the year 3000 on, or without a timezone. The one check behind both the
    admin API (``POST /admin/v1/prices``) and ``tollgate prices set``."""
    now = now or datetime.now(UTC)
    earliest = now + PRICE_LEAD
    start = effective_from or earliest
    if start.tzinfo is None:
        raise ValueError("effective_from must be timezone-aware")
    if start < now:
        raise PastEffectiveFrom(start, now)
    if start < earliest:
        raise ValueError(f"effective_from must be at least {PRICE_LEAD.seconds} s ahead: every gateway "
                         "loads new prices within that time (omit it to start as soon as it can)")
    if start >= LATEST_TIME:  # a row stored in year 10000 could not be read back: no price book would load
        raise ValueError(f"effective_from must be before {LATEST_TIME.date().isoformat()}")
    return start


def pico_to_usd_per_mtok(pico_per_token: int) -> Decimal:
    return (Decimal(pico_per_token) / PICO_PER_TOKEN_PER_USD_PER_MTOK).normalize()


class PriceBook:
    """An immutable in-memory snapshot of the ``prices`` table, for the hot path."""

    def __init__(self, rows: Iterable[tuple[str, datetime, Price]] = ()) -> None:
        by_model: dict[str, list[tuple[datetime, Price]]] = {}
        for model, effective_from, price in rows:
            if effective_from.tzinfo is None:
                raise ValueError("effective_from must be timezone-aware")
            by_model.setdefault(model, []).append((effective_from, price))
        self._starts: dict[str, list[datetime]] = {}
        self._prices: dict[str, list[Price]] = {}
        for model, entries in by_model.items():
            entries.sort(key=lambda entry: entry[0])
            self._starts[model] = [start for start, _ in entries]
            self._prices[model] = [price for _, price in entries]

    def models(self) -> list[str]:
        return sorted(self._starts)

    def price_for(self, model: str, at: datetime | None = None) -> Price:
        """The price of ``model`` in effect at ``at`` (now when omitted)."""
        starts = self._starts.get(model)
        when = at if at is not None else datetime.now(UTC)
        if when.tzinfo is None:
            raise ValueError("at must be timezone-aware")
        index = bisect.bisect_right(starts, when) - 1 if starts else -1
        if index < 0:
            raise PriceNotFound(f"model {model!r} has no price in effect at {when.isoformat()}")
        return self._prices[model][index]
