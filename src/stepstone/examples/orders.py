"""Order processing: reserve stock, hold briefly, wait for payment, then ship or release.

    reserve_stock --> cooling_off (timer) --> await_payment --payment_received--> ship --> send_receipt
                                                  |--order_cancelled / 1 day---> release_stock

Run it with `stepstone demo`, or with a worker:
`stepstone worker --app stepstone.examples.orders:registry`.
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel, Field

from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow


class OrderLine(BaseModel):
    sku: str
    quantity: int = Field(gt=0)


class Order(BaseModel):
    """The instance's state: validated on start and after every step, stored as JSON."""

    order_id: str
    customer: str
    lines: list[OrderLine]
    reservation_id: str | None = None
    payment_id: str | None = None
    shipment_id: str | None = None
    outcome: str | None = None


class OutOfStock(Exception):
    """Retrying cannot help: the step fails at once."""


class Warehouse:
    """Stands in for a stock service that deduplicates requests by an idempotency key.

    A real one is an HTTP call with an `Idempotency-Key` header: if the worker crashes after the
    call but before the step's commit, the step runs again with the same key and the service
    answers with the first reservation instead of reserving twice.
    """

    def __init__(self) -> None:
        self.by_key: dict[str, str] = {}  # idempotency key -> the reservation it made
        self.held: dict[str, list[OrderLine]] = {}  # reservation -> what it holds

    def reserve(self, key: str, lines: list[OrderLine]) -> str:
        if key in self.by_key:  # a repeated request gets the first answer
            return self.by_key[key]
        if any(line.sku == "out-of-stock" for line in lines):
            raise OutOfStock("cannot reserve sku out-of-stock")
        reservation = f"res-{len(self.by_key) + 1}"
        self.by_key[key] = reservation
        self.held[reservation] = lines
        return reservation

    def release(self, reservation: str | None) -> None:
        self.held.pop(reservation or "", None)  # releasing twice is harmless


warehouse = Warehouse()

COOLING_OFF = timedelta(seconds=2)
"""How long a customer may still change the order before we ask for payment (short, for the demo)."""

orders: Workflow[Order] = Workflow("order", version=1, state=Order)


@orders.step(start=True, next="cooling_off", retry=Retry(max_attempts=5, backoff=0.5, non_retryable=(OutOfStock,)))
def reserve_stock(ctx: StepContext, order: Order) -> None:
    # The same key on every attempt of this step visit, on any worker.
    order.reservation_id = warehouse.reserve(ctx.idempotency_key, order.lines)
    # Staged in the outbox; written in this step's commit, or not at all.
    ctx.emit("order.reserved", {"order_id": order.order_id, "reservation": order.reservation_id},
             key=order.order_id)


orders.timer("cooling_off", delay=COOLING_OFF, next="await_payment")

orders.wait(
    "await_payment",
    signals={"payment_received": "ship", "order_cancelled": "release_stock"},
    timeout=timedelta(days=1),
    on_timeout="release_stock",
)


@orders.step(next="send_receipt")
async def ship(ctx: StepContext, order: Order) -> None:
    payment = ctx.signal.payload if ctx.signal else None
    if isinstance(payment, dict):  # a signal may carry no payload: `stepstone signal ID payment_received`
        order.payment_id = payment.get("payment_id")
    order.shipment_id = f"ship-{order.order_id}"
    ctx.emit("order.shipped", {"order_id": order.order_id, "shipment": order.shipment_id}, key=order.order_id)


@orders.step(next=None)
def send_receipt(ctx: StepContext, order: Order) -> None:
    order.outcome = "shipped"
    ctx.emit("order.receipt", {"order_id": order.order_id, "customer": order.customer}, key=order.order_id)


@orders.step(next=None)
def release_stock(ctx: StepContext, order: Order) -> None:
    warehouse.release(order.reservation_id)
    order.outcome = "cancelled" if ctx.signal else "payment timed out"
    ctx.emit("order.released", {"order_id": order.order_id, "reason": order.outcome}, key=order.order_id)


registry = Registry(orders)
