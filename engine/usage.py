"""Metered usage: the one vocabulary of token kinds, from the engine's final record to the statements.

No torch: the gateway, billing and the dashboard import it (the engine's torch-free face, with
``engine.protocol``). Adding a token kind is a line in ``TokenKind`` and one in ``KINDS``, plus the
migration that gives the ledger (and, if priced, the price book) its column (docs/architecture.md,
"Adding a token kind").

Invariants:
- ``TokenKind`` names every kind of token the platform counts; ``KINDS[kind]`` says how it is counted:
  ``field`` is the count's name everywhere it is written down (the engine's final record, the usage
  outbox, the ``usage_events`` ledger and the ``usage_hourly`` rollups); ``within`` the kind it never
  exceeds; ``price`` the ``billing.prices.Price`` field that charges it per token (None: a detail, never
  priced apart); ``surcharge`` that it is charged on top of ``within``'s own price (a prompt-cache
  product) rather than being a part of it.
- Parts (``within`` set, not a surcharge) are subsets of their kind, and a kind's parts together never
  exceed it: cached ≤ input; host + disk ≤ cached; accepted + rejected prediction ≤ output. A
  surcharge never exceeds its kind on its own.
- ``billed()`` partitions what a request is charged for among the priced kinds: a priced kind's own
  tokens are its count less its priced parts (``input``: the prompt tokens not served from the prompt
  cache; ``cached_input``: those served from it), plus each surcharge's count.
- A ``Usage`` is a value: counts are non-negative ints, zero counts are not stored (``Usage()`` is no
  usage), ``+`` adds kind by kind. ``fields()`` / ``from_fields`` are its flat wire form, the same names
  the ledger uses; a field missing from the wire reads as 0 (written by a producer older than the kind).
- The prompt-cache tiers are named here once (``CACHE_TIERS``): the device pool, host memory, disk; the
  cached tokens of the tiers after the device are their own kinds (``TIER_KINDS``), the device's are
  the rest of ``cached_input``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class TokenKind(StrEnum):
    INPUT = "input"                              # prompt tokens (OpenAI's prompt/input tokens)
    CACHED_INPUT = "cached_input"                # of those, served from the prompt cache
    CACHED_HOST = "cached_host"                  # of those, loaded back from host memory
    CACHED_DISK = "cached_disk"                  # of those, read from the disk tier
    OUTPUT = "output"                            # completion tokens, rejected prediction tokens included
    ACCEPTED_PREDICTION = "accepted_prediction"  # of those, Predicted Outputs' drafts that were kept
    REJECTED_PREDICTION = "rejected_prediction"  # of those, drafts computed, thrown away, billed as output
    CACHE_WRITE = "cache_write"                  # prompt tokens newly written to the prompt cache
    CACHE_PINNED = "cache_pinned"                # prompt tokens pinned in host memory (cache ttl)
    CACHE_RETAINED = "cache_retained"            # prompt tokens kept on disk (prompt_cache_retention "24h")


@dataclass(frozen=True, slots=True)
class KindSpec:
    field: str
    about: str
    within: TokenKind | None = None
    price: str | None = None
    surcharge: bool = False


K = TokenKind
KINDS: dict[TokenKind, KindSpec] = {  # a kind's bound comes before it; priced kinds in statement order
    K.INPUT: KindSpec("prompt_tokens", "Prompt tokens.", price="input"),
    K.CACHED_INPUT: KindSpec("cached_tokens", "Prompt tokens served from the prompt cache.", within=K.INPUT,
                             price="cached_input"),
    K.CACHED_HOST: KindSpec("cached_host_tokens", "Of the cached tokens, those loaded from host memory.",
                            within=K.CACHED_INPUT),
    K.CACHED_DISK: KindSpec("cached_disk_tokens", "Of the cached tokens, those read from disk.",
                            within=K.CACHED_INPUT),
    K.OUTPUT: KindSpec("completion_tokens", "Completion tokens (rejected prediction tokens included).",
                       price="output"),
    K.ACCEPTED_PREDICTION: KindSpec(
        "accepted_prediction_tokens",
        "Predicted Outputs: prediction tokens accepted into the output (of completion_tokens).",
        within=K.OUTPUT),
    K.REJECTED_PREDICTION: KindSpec(
        "rejected_prediction_tokens",
        "Predicted Outputs: prediction tokens thrown away; counted in completion_tokens and "
        "billed as output.",
        within=K.OUTPUT),
    K.CACHE_WRITE: KindSpec("cache_write_tokens", "Prompt tokens newly written to the prompt cache.",
                            within=K.INPUT, price="cache_write", surcharge=True),
    K.CACHE_PINNED: KindSpec("cache_pinned_tokens", "Prompt tokens pinned in host memory (cache ttl).",
                             within=K.INPUT, price="cache_pin", surcharge=True),
    K.CACHE_RETAINED: KindSpec("cache_retained_tokens", "Prompt tokens kept on disk (cache retention).",
                               within=K.INPUT, price="cache_retention", surcharge=True),
}
del K

# The kinds charged per token, in the order statements and the Costs API list them.
PRICED_KINDS: tuple[TokenKind, ...] = tuple(k for k, s in KINDS.items() if s.price is not None)
# The prompt-cache products: charged on top of the prompt tokens they apply to.
SURCHARGE_KINDS: tuple[TokenKind, ...] = tuple(k for k, s in KINDS.items() if s.surcharge)
FIELDS: tuple[str, ...] = tuple(s.field for s in KINDS.values())
KIND_OF_FIELD: dict[str, TokenKind] = {s.field: k for k, s in KINDS.items()}

# Where the prompt cache keeps blocks, fastest first, and the kind counting the cached tokens of each tier
# after the device pool (the device's share is the rest of ``cached_input``).
CACHE_TIERS: tuple[str, ...] = ("device", "host", "disk")
TIER_KINDS: dict[str, TokenKind] = {"host": TokenKind.CACHED_HOST, "disk": TokenKind.CACHED_DISK}


def parts_of(kind: TokenKind) -> tuple[TokenKind, ...]:
    """The kinds that are subsets of ``kind`` (not its surcharges)."""
    return tuple(k for k, s in KINDS.items() if s.within is kind and not s.surcharge)


def root_of(kind: TokenKind) -> TokenKind:
    """The top kind ``kind`` belongs to (``INPUT`` or ``OUTPUT``): the side of the request it counts."""
    while (within := KINDS[kind].within) is not None:
        kind = within
    return kind


def cost_field(kind: TokenKind) -> str:
    """The ledger and rollup column holding the cost of a priced kind's tokens."""
    return f"{kind.value}_cost_pico_usd"


COST_FIELDS: tuple[str, ...] = tuple(cost_field(k) for k in PRICED_KINDS)


@dataclass(frozen=True, slots=True)
class Usage:
    counts: Mapping[TokenKind, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        counts: dict[TokenKind, int] = {}
        for kind, value in self.counts.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                name = KINDS[TokenKind(kind)].field
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
            if value:
                counts[TokenKind(kind)] = value
        object.__setattr__(self, "counts", counts)

    @classmethod
    def of(cls, **counts: int) -> Usage:
        """``Usage.of(prompt_tokens=10, cached_tokens=4)``: counts by their field names."""
        return cls.from_fields(counts, strict=True)

    @classmethod
    def from_fields(cls, data: Mapping[str, Any], *, strict: bool = False) -> Usage:
        """From the flat wire form; a missing field is 0, an unknown one is ignored unless ``strict``."""
        if strict and (unknown := set(data) - set(KIND_OF_FIELD)):
            raise ValueError(f"unknown usage fields: {sorted(unknown)}")
        return cls({kind: data[f] for f, kind in KIND_OF_FIELD.items() if f in data and data[f] is not None})

    def __getitem__(self, kind: TokenKind) -> int:
        return self.counts.get(kind, 0)

    def __getattr__(self, name: str) -> int:
        """A count by its field name (``usage.cache_write_tokens``), for readers of the flat form."""
        kind = KIND_OF_FIELD.get(name)
        if kind is None:
            raise AttributeError(f"'Usage' object has no attribute {name!r}")
        return self[kind]

    def __add__(self, other: Usage) -> Usage:
        return Usage({k: self[k] + other[k] for k in TokenKind})

    def __bool__(self) -> bool:
        return bool(self.counts)

    def replace(self, **counts: int) -> Usage:
        """This usage with the counts named by field replaced."""
        return Usage({**self.counts, **{KIND_OF_FIELD[f]: v for f, v in counts.items()}})

    def fields(self) -> dict[str, int]:
        """The flat wire form: every kind by its field name."""
        return {s.field: self[k] for k, s in KINDS.items()}

    @property
    def prompt_tokens(self) -> int:
        return self[TokenKind.INPUT]

    @property
    def cached_tokens(self) -> int:
        return self[TokenKind.CACHED_INPUT]

    @property
    def completion_tokens(self) -> int:
        return self[TokenKind.OUTPUT]

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def problems(self) -> list[str]:
        """What breaks the kinds' bounds (empty when none)."""
        out = []
        for kind, spec in KINDS.items():
            if spec.within is not None and spec.surcharge and self[kind] > self[spec.within]:
                out.append(f"{spec.field} exceeds {KINDS[spec.within].field}")
        for kind in KINDS:
            parts = parts_of(kind)
            if parts and sum(self[p] for p in parts) > self[kind]:
                names = " + ".join(KINDS[p].field for p in parts)
                out.append(f"{names} exceeds {KINDS[kind].field}")
        return out

    def check(self) -> Usage:
        """Itself, or ``ValueError`` naming the first broken bound."""
        if problems := self.problems():
            raise ValueError(problems[0])
        return self

    def clamped(self) -> Usage:
        """Within its bounds: each kind cut to what its kind leaves (parts in ``KINDS`` order), so a count
        merged from several sources never claims more than the tokens it is part of."""
        counts = dict(self.counts)
        for kind in KINDS:  # a kind's bound comes before it in KINDS
            spec = KINDS[kind]
            if spec.within is None:
                continue
            room = counts.get(spec.within, 0)
            if not spec.surcharge:
                room -= sum(counts.get(p, 0) for p in parts_of(spec.within) if _before(p, kind))
            counts[kind] = max(0, min(counts.get(kind, 0), room))
        return Usage(counts)

    def billed(self) -> dict[TokenKind, int]:
        """The tokens charged at each priced kind's price (``PRICED_KINDS`` order): its own tokens, less
        those of its priced parts, which their own price charges."""
        return {k: self[k] - sum(self[p] for p in parts_of(k) if KINDS[p].price is not None)
                for k in PRICED_KINDS}


def _before(a: TokenKind, b: TokenKind) -> bool:
    order = list(KINDS)
    return order.index(a) < order.index(b)


def total(usages: Iterable[Usage]) -> Usage:
    out = Usage()
    for usage in usages:
        out = out + usage
    return out
