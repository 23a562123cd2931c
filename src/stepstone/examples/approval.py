"""An expense approval: a human task for a candidate group, a reminder, an escalation when it is due,
and a correlated "receipt received" message.

`submit` files the claim; the task `approve` is offered to the group `approvers`, reminds after
`REMIND`, and when it is still open at its due date (`DUE`) it escalates to the group
`finance-leads`. Approving records who approved (`approved`, from `ctx.task`) and goes on to
`await_receipt`, a wait subscribed to the message `receipt_received` correlated by the expense id;
`book` then records the receipt. Rejecting ends at `rejected`.

Run it with `stepstone demo approval`.
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel

from stepstone import Registry, StepContext, Workflow

REMIND = timedelta(seconds=0.3)
DUE = timedelta(seconds=0.8)


class Expense(BaseModel):
    expense_id: str
    employee: str
    amount: float
    status: str = "SUBMITTED"
    approved_by: str | None = None
    comment: str | None = None
    receipt: str | None = None


class Approve(BaseModel):
    """The payload of an approval."""

    comment: str = ""


class Reject(BaseModel):
    """The payload of a rejection: why."""

    reason: str


approval: Workflow[Expense] = Workflow("expense_approval", version=1, state=Expense)


@approval.step(start=True, next="approve")
async def submit(ctx: StepContext, state: Expense) -> None:  # noqa: ARG001 - every handler takes ctx
    state.status = "AWAITING_APPROVAL"


approval.task(
    "approve",
    title="Approve {amount} for {employee} ({expense_id})",
    decisions={"approve": "approved", "reject": "rejected"},
    payloads={"approve": Approve, "reject": Reject},
    candidate_groups=["approvers"],
    show=("expense_id", "employee", "amount"),
    reminder=REMIND,
    due=DUE,
    escalate_to_group="finance-leads",
)

@approval.step(next="await_receipt")
async def approved(ctx: StepContext, state: Expense) -> None:
    assert ctx.task is not None  # the completion that led here: who decided, and with what
    state.approved_by = ctx.task.actor
    state.comment = (ctx.task.payload or {}).get("comment")


approval.wait("await_receipt", messages={"receipt_received": "book"}, correlation="expense_id",
              timeout=timedelta(days=30), on_timeout="rejected")


@approval.step(next=None)
async def book(ctx: StepContext, state: Expense) -> None:
    assert ctx.signal is not None  # the message that moved the wait
    state.receipt = str((ctx.signal.payload or {}).get("receipt_id"))
    state.status = "APPROVED"


@approval.step(next=None)
async def rejected(ctx: StepContext, state: Expense) -> None:
    if ctx.task is not None:
        state.approved_by = ctx.task.actor
    state.status = "REJECTED"


registry = Registry(approval)
