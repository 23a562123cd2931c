"""Workflows with external steps, for the external-task tests."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from stepstone import Registry, Retry, StepContext, Workflow

payment: Workflow[dict[str, Any]] = Workflow("payment", version=1)  # a plain JSON object as state


@payment.step(start=True, next="charge")
def begin(ctx: StepContext, state: dict[str, Any]) -> None:
    state.setdefault("declined", False)


payment.external("charge", topic="payments", next="receipt", inputs=["order_id", "amount"],
                 errors={"card_declined": "declined"}, retry=Retry(max_attempts=3, backoff=10, multiplier=2))


@payment.step
def receipt(ctx: StepContext, state: dict[str, Any]) -> None:
    state["receipt"] = f"{state['order_id']} paid with {state['charge_id']}"


@payment.step
def declined(ctx: StepContext, state: dict[str, Any]) -> None:
    state["declined"] = True
    assert ctx.external is not None and ctx.external.outcome == "error"
    state["why"] = ctx.external.error


class Parcels(BaseModel):
    parcels: list[str] = Field(default_factory=lambda: ["p1", "p2", "p3"])
    labels: dict[str, Any] = Field(default_factory=dict)
    done: bool = False


shipping: Workflow[Parcels] = Workflow("shipping", version=1, state=Parcels)
shipping.fork("each", map_over="parcels", branch="label", start=True)
shipping.external("label", topic="labels", next="joined", inputs=["parcels"])
shipping.join("joined", fork="each", next="finish")


@shipping.step
def finish(ctx: StepContext, state: Parcels) -> None:
    state.done = True


registry = Registry(payment, shipping)
