"""Workflows the API and UI tests run: a job that can be made to fail, then waits for approval; an
expense a person approves in a task (with a payload form); an order that waits for a message (and
can be made to fail at its first step, to migrate failed orders to v2 and retry them there)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from stepstone.authoring.workflow import CompensationContext, Registry, Retry, StepContext, Workflow, from_state


class Job(BaseModel):
    name: str
    log: list[str] = []


FAILING: set[str] = set()
"""Job names whose `charge` step raises, and order ids whose `place` does (a test clears one to let its
retry pass)."""


class Declined(Exception):
    pass


job: Workflow[Job] = Workflow("job", version=1, state=Job)


@job.step(start=True, next="approval", retry=Retry(max_attempts=1))
def charge(ctx: StepContext, state: Job) -> None:
    if state.name in FAILING:
        raise Declined(f"card declined for {state.name}")
    state.log.append("charged")
    ctx.emit("job.charged", {"name": state.name}, key=state.name)


job.wait("approval", signals={"approve": "ship", "reject": "refund"})


@job.step(next=None)
def ship(ctx: StepContext, state: Job) -> None:
    state.log.append("shipped")


@job.step(next=None)
def refund(ctx: StepContext, state: Job) -> None:
    state.log.append("refunded")


class Expense(BaseModel):
    employee: str
    amount: int
    approver: str | None = None
    call_at: str | None = None
    outcome: str = ""
    comment: str = ""


class Approval(BaseModel):
    comment: str
    approved_amount: int


expense: Workflow[Expense] = Workflow("expense", version=1, state=Expense)


@expense.step(start=True, next="approve")
def submit(ctx: StepContext, state: Expense) -> None:
    state.outcome = "submitted"


expense.task("approve", title="Approve {employee}'s expense", decisions={"approve": "pay", "reject": "decline"},
             payloads={"approve": Approval}, assignee=from_state("approver"), candidate_users=["mia"],
             candidate_groups=["finance"], show=("employee", "amount"), priority=60,
             follow_up=from_state("call_at"))


@expense.step(next=None)
def pay(ctx: StepContext, state: Expense) -> None:
    assert ctx.task is not None
    state.outcome = f"paid by {ctx.task.actor}"
    state.comment = str((ctx.task.payload or {}).get("comment"))


@expense.step(next=None)
def decline(ctx: StepContext, state: Expense) -> None:
    state.outcome = "declined"


class Order(BaseModel):
    order_id: str
    got: str = ""


order: Workflow[Order] = Workflow("order", version=1, state=Order)


@order.step(start=True, next="await_receipt", retry=Retry(max_attempts=1))
def place(ctx: StepContext, state: Order) -> None:
    if state.order_id in FAILING:
        raise Declined(f"no stock for {state.order_id}")
    state.got = ""


order.wait("await_receipt", messages={"receipt": "filed"}, signals={"nudge": "filed"}, correlation="order_id")


@order.step(next=None)
def filed(ctx: StepContext, state: Order) -> None:
    state.got = "filed"


# Version 2 of the order (the migration tests move v1 instances to it): it also records who filed it.
order_v2: Workflow[Order] = Workflow("order", version=2, state=Order)
order_v2.step(start=True, next="await_receipt", retry=Retry(max_attempts=1))(place)
order_v2.wait("await_receipt", messages={"receipt": "filed"}, signals={"nudge": "filed"}, correlation="order_id")


@order_v2.step(next=None, name="filed")
def filed_v2(ctx: StepContext, state: Order) -> None:
    state.got = "filed by v2"


# A saga whose compensation can be made to fail: `book`, then `pay` (fails for a trip in FAILING), which
# compensates `book` with `unbook` (fails for a trip in FAILING_UNDO): the instance is then
# COMPENSATION_FAILED, an incident a retry resumes once the cause is gone.
class Trip(BaseModel):
    trip: str
    undone: bool = False


FAILING_UNDO: set[str] = set()
trip: Workflow[Trip] = Workflow("trip", version=1, state=Trip)


@trip.step(start=True, next="pay")
def book(ctx: StepContext, state: Trip) -> None:
    ctx.record(f"booking-{state.trip}")


@trip.step(next=None, name="pay", retry=Retry(max_attempts=1))
def pay_trip(ctx: StepContext, state: Trip) -> None:
    if state.trip in FAILING:
        raise Declined(f"payment refused for {state.trip}")


@trip.compensation("book", retry=Retry(max_attempts=1))
def unbook(ctx: CompensationContext, state: Trip, booking: Any) -> None:
    if state.trip in FAILING_UNDO:
        raise Declined(f"cannot cancel {booking}")
    state.undone = True


registry = Registry(job, expense, order, order_v2, trip)
