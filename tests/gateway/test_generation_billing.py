"""What a generation bills and holds, on its own (no servers): the price is the row in effect when the
request arrived, whenever it ends (the ledger's rollups and statements re-price each row at its
``created_at``, and admission held its cost at that price); its admission lease, and with it its cost
hold, is renewed on a timer until it ends."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from billing.prices import Price, PriceBook, cost_pico_usd
from engine.usage import Usage
from gateway.generation.service import Generation

T0 = datetime(2026, 11, 1, tzinfo=UTC)
OLD = Price.of(input=1_000_000, output=2_000_000)
NEW = Price.of(input=5_000_000, output=9_000_000)


def generation(arrived: datetime, book: PriceBook, request_class: str = "interactive") -> Generation:
    gen = Generation(runtime=SimpleNamespace(prices=book, request_class=request_class),  # type: ignore[arg-type]
                     principal=None, route=SimpleNamespace(name="m"), request_id="r",  # type: ignore[arg-type]
                     prompts=[[1] * 10], sampling={}, n=1, max_tokens=5, tier="standard", _created_at=arrived)
    gen.usage = Usage.of(prompt_tokens=10, cached_tokens=4, completion_tokens=5)
    return gen


def test_a_request_running_across_a_price_change_is_billed_at_the_price_it_arrived_under() -> None:
    """The new row took effect an hour after the request arrived (and long before now, when it is
    priced): the old row prices it."""
    book = PriceBook([("m", T0, OLD), ("m", T0 + timedelta(hours=1), NEW)])
    arrived = T0 + timedelta(minutes=59, seconds=59)
    assert generation(arrived, book)._charge().total == cost_pico_usd(OLD, 10, 4, 5, "interactive")
    assert generation(arrived, book, "batch")._charge().total == cost_pico_usd(OLD, 10, 4, 5, "batch")
    later = generation(T0 + timedelta(hours=1), book)
    assert later._charge().total == cost_pico_usd(NEW, 10, 4, 5, "interactive")


def test_the_price_admission_fetched_is_the_one_billed() -> None:
    """``start`` keeps the row it held the cost at; ``finish`` bills that very row, even if the price book
    was reloaded meanwhile with the row removed or replaced."""
    gen = generation(T0, PriceBook([("m", T0, NEW)]))
    gen._price = OLD
    assert gen._charge().total == cost_pico_usd(OLD, 10, 4, 5, "interactive")


async def test_the_admission_lease_is_renewed_on_a_timer_until_the_end() -> None:
    """A request may go longer than the lease's ttl without an engine record (an embedding sends none; a
    long prefill; a slow client): its lease, and with it its cost hold, is renewed every third of the ttl
    whatever it reads, and no more once it finished."""
    import asyncio

    from tests.polling import eventually

    renewed: list[object] = []

    async def renew_lease(admission: object) -> None:
        renewed.append(admission)

    gen = generation(T0, PriceBook([("m", T0, OLD)]))
    gen.runtime = SimpleNamespace(settings=SimpleNamespace(stream_lease_ttl_s=0.06),  # type: ignore[assignment]
                                  admission=SimpleNamespace(renew_lease=renew_lease))
    gen.admission = "lease"  # type: ignore[assignment]
    task = asyncio.create_task(gen._renew_lease())
    await eventually(lambda: len(renewed) >= 3, "three renewals")
    gen._finished = True
    await asyncio.wait_for(task, timeout=5)  # it ends by itself once the generation finished
    assert set(renewed) == {"lease"}
