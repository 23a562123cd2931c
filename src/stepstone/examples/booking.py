"""A booking saga: reserve a flight, reserve a hotel, charge the card.

Each reservation records what it reserved (`ctx.record`) and declares a compensation that
releases it. When `charge_card` fails for good (the card is declined: never retried), the saga
compensates what it completed, in reverse order of completion: the hotel, then the flight. Each
compensation is retried under its own policy and journaled; `stepstone demo saga` runs it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from stepstone import CompensationContext, Registry, Retry, StepContext, Workflow


class CardDeclined(Exception):
    """The payment provider refused the card: retrying will not help."""


class Booking(BaseModel):
    trip_id: str
    traveller: str
    decline_card: bool = True
    flight: str | None = None
    hotel: str | None = None
    charged: bool = False
    payment_key: str | None = None
    released: list[str] = Field(default_factory=list)


booking: Workflow[Booking] = Workflow("booking", version=1, state=Booking)


@booking.step(start=True, next="reserve_hotel")
def reserve_flight(ctx: StepContext, state: Booking) -> None:
    state.flight = f"FL-{state.trip_id}"
    ctx.record({"flight": state.flight, "key": ctx.idempotency_key})


@booking.compensation("reserve_flight", retry=Retry(max_attempts=5, backoff=0.1))
def cancel_flight(ctx: CompensationContext, state: Booking, recorded: Any) -> None:
    state.released.append(recorded["flight"])  # a real one calls the airline with ctx.idempotency_key
    state.flight = None
    ctx.emit("booking.flight_released", {"trip_id": state.trip_id, "flight": recorded["flight"]}, key=state.trip_id)


@booking.step(next="charge_card")
async def reserve_hotel(ctx: StepContext, state: Booking) -> None:
    state.hotel = f"HT-{state.trip_id}"
    ctx.record({"hotel": state.hotel})


@booking.compensation("reserve_hotel", retry=Retry(max_attempts=5, backoff=0.1))
async def cancel_hotel(ctx: CompensationContext, state: Booking, recorded: Any) -> None:
    state.released.append(recorded["hotel"])
    state.hotel = None
    ctx.emit("booking.hotel_released", {"trip_id": state.trip_id, "hotel": recorded["hotel"]}, key=state.trip_id)


@booking.step(next=None, retry=Retry(max_attempts=3, backoff=0.1, non_retryable=(CardDeclined,)))
def charge_card(ctx: StepContext, state: Booking) -> None:
    _charge(state, key=ctx.idempotency_key)
    state.charged = True


def _charge(state: Booking, *, key: str) -> None:
    """Stands in for the payment provider (which would dedupe on `key`): it declines this card."""
    if state.decline_card:
        raise CardDeclined(f"card of {state.traveller} declined")
    state.payment_key = key


registry = Registry(booking)
