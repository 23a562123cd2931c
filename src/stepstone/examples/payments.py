"""Payment with an external task: a worker outside this process, in any language, charges the card.

    begin --> charge (external task on topic "payments") --> receipt
                  |--business error card_declined--------> declined

The task's payload is the order id and the amount; the worker completes it with the variable
`charge_id`, which lands in the state. Run a worker for it, serve the tasks over HTTP, and answer
them with curl: docs/external-tasks.md.
"""

from __future__ import annotations

from pydantic import BaseModel

from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow


class Payment(BaseModel):
    order_id: str
    amount: int
    charge_id: str | None = None
    receipt: str | None = None
    declined: bool = False


payment: Workflow[Payment] = Workflow("payment", version=1, state=Payment)


@payment.step(start=True, next="charge")
def begin(_ctx: StepContext, _state: Payment) -> None:
    """Nothing to do here but show that an external step sits between ordinary ones."""


payment.external("charge", topic="payments", next="receipt", inputs=["order_id", "amount"],
                 errors={"card_declined": "declined"}, retry=Retry(max_attempts=5, backoff=5, max_backoff=300))


@payment.step
def receipt(_ctx: StepContext, state: Payment) -> None:
    state.receipt = f"order {state.order_id}: {state.amount} charged as {state.charge_id}"


@payment.step
def declined(ctx: StepContext, state: Payment) -> None:
    state.declined = True
    state.receipt = f"order {state.order_id} declined: {ctx.external.error['message'] if ctx.external else ''}"


registry = Registry(payment)
