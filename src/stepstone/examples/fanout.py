"""Fan-out and a child workflow: ship an order from ten regions at once, then bill it.

`ship` forks one branch per region (a map over the state list `regions`); each
branch runs `ship_region`, a slow call that takes a second, and ends at the join
`shipped`. Branches run in parallel on any free worker slot or worker process.
Each branch writes its own key of `shipments`, so their changes to the shared
state never collide. Once every branch has reached the join, `bill` starts an
`invoice` child workflow and waits for it; `record_invoice` reads the child's
result from `ctx.child`.

Run it with `stepstone demo fanout`.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from stepstone import Registry, StepContext, Workflow

REGIONS = ["ams", "bom", "cdg", "fra", "gru", "iad", "lhr", "nrt", "sin", "syd"]
SHIP_SECONDS = 1.0


class Shipment(BaseModel):
    order_id: str
    regions: list[str] = Field(default_factory=lambda: list(REGIONS))
    shipments: dict[str, str] = Field(default_factory=dict)
    invoice_id: str | None = None
    invoice_number: str | None = None


class Invoice(BaseModel):
    order_id: str
    parcels: int
    number: str | None = None


shipping: Workflow[Shipment] = Workflow("shipping", version=1, state=Shipment)
shipping.fork("ship", map_over="regions", branch="ship_region", start=True)


@shipping.step(next="shipped")
async def ship_region(ctx: StepContext, state: Shipment) -> None:
    assert ctx.branch is not None  # every map branch knows its item
    region = str(ctx.branch.item)
    await asyncio.sleep(SHIP_SECONDS)  # the carrier's slow booking call; ctx.idempotency_key dedups it
    state.shipments[region] = f"parcel-{region}-{ctx.idempotency_key[-6:]}"


shipping.join("shipped", fork="ship", next="bill")


@shipping.child(workflow="invoice", next="record_invoice")
def bill(_: StepContext, state: Shipment) -> Invoice:
    return Invoice(order_id=state.order_id, parcels=len(state.shipments))


@shipping.step(next=None)
def record_invoice(ctx: StepContext, state: Shipment) -> None:
    assert ctx.child is not None  # the step after a child step always has its result
    state.invoice_id = ctx.child.instance_id
    state.invoice_number = ctx.child.state["number"]


invoice: Workflow[Invoice] = Workflow("invoice", version=1, state=Invoice)


@invoice.step(start=True, next=None)
def issue(_: StepContext, state: Invoice) -> None:
    state.number = f"INV-{state.order_id}-{state.parcels}"


registry = Registry(shipping, invoice)
