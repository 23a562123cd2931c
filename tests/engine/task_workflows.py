"""Workflows of the human task and message tests."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import BaseModel

from stepstone.authoring.workflow import Registry, StepContext, Workflow, from_item, from_state


class Expense(BaseModel):
    expense_id: str
    employee: str
    manager: str = "mia"
    amount: float
    note: str = ""
    outcome: str = ""
    decided_by: str = ""
    comment: str = ""


class Approval(BaseModel):
    comment: str
    approved_amount: float | None = None


expense = Workflow("expense", version=1, state=Expense)


@expense.step(start=True, next="approve")
async def submit(ctx: StepContext, state: Expense) -> None:
    state.note = f"submitted {state.expense_id}"


expense.task(
    "approve",
    title="Approve expense {expense_id} of {employee}",
    decisions={"approve": "pay", "reject": "notify"},
    payloads={"approve": Approval},
    candidate_groups=["finance"],
    owner=from_state("manager"),
    priority=70,
    show=("amount", "employee"),
    reminder=timedelta(hours=1),
    due=timedelta(hours=4),
    escalate_to_group="finance-leads",
    expire=timedelta(days=2),
    on_expire="expired",
)


@expense.step(next=None)
async def pay(ctx: StepContext, state: Expense) -> None:
    assert ctx.task is not None
    state.outcome = "APPROVED"
    state.decided_by = ctx.task.actor or ""
    state.comment = str((ctx.task.payload or {}).get("comment"))


@expense.step(next=None)
async def notify(ctx: StepContext, state: Expense) -> None:
    assert ctx.task is not None
    state.outcome = "REJECTED"
    state.decided_by = ctx.task.actor or ""


@expense.step(next=None)
async def expired(ctx: StepContext, state: Expense) -> None:
    state.outcome = "EXPIRED"


# Four eyes on data that must not change unseen: a task that requires version stability, assigned
# from the state, beside a branch that changes the shown amount.
review = Workflow("review", version=1)


@review.step(start=True, next="split")
async def prepare(ctx: StepContext, state: dict[str, Any]) -> None:
    state.setdefault("amount", 10)


review.fork("split", branches={"check": "check", "edit": "edit"})
review.task("check", title="Check amount", decisions={"ok": "both"}, assignee=from_state("reviewer"),
            show=("amount",), require_version_stability=True)


@review.step(next="both")
async def edit(ctx: StepContext, state: dict[str, Any]) -> None:
    if state.get("edit"):
        state["amount"] = state["amount"] + 1


review.join("both", fork="split", next="finish")


@review.step(next=None)
async def finish(ctx: StepContext, state: dict[str, Any]) -> None:
    state["done"] = True


# Tasks inside branches: one per item, each for its own user.
parallel = Workflow("parallel_tasks", version=1)


@parallel.step(start=True, next="each")
async def begin(ctx: StepContext, state: dict[str, Any]) -> None:
    state.setdefault("users", ["ann", "ben"])


parallel.fork("each", map_over="users", branch="sign")
parallel.task("sign", title="Sign", decisions={"signed": "all_signed"}, assignee=from_item(),
               candidate_users=from_state("users"))
parallel.join("all_signed", fork="each", next="close")


@parallel.step(next=None)
async def close(ctx: StepContext, state: dict[str, Any]) -> None:
    state["closed"] = True


# A wait for a correlated message (or a signal), with a timeout.
class Receipt(BaseModel):
    order_id: str
    got: str = ""
    via: str = ""


receipt = Workflow("receipt", version=1, state=Receipt)


@receipt.step(start=True, next="await_receipt")
async def order(ctx: StepContext, state: Receipt) -> None:
    state.got = ""


receipt.wait("await_receipt", messages={"receipt_received": "filed"}, signals={"skip": "filed"},
             correlation="order_id", timeout=timedelta(minutes=10), on_timeout="late")


@receipt.step(next=None)
async def filed(ctx: StepContext, state: Receipt) -> None:
    assert ctx.signal is not None
    state.via = ctx.signal.name
    state.got = str((ctx.signal.payload or {}).get("n"))


@receipt.step(next=None)
async def late(ctx: StepContext, state: Receipt) -> None:
    state.via = "timeout"


# A call-back task put aside until its follow-up date: seconds from opening, or an instant, from the state.
callback = Workflow("callback", version=1)
callback.task("call", title="Call {customer} back", decisions={"called": "logged"}, candidate_groups=["desk"],
              follow_up=from_state("call_at"), start=True)


@callback.step(next=None)
async def logged(ctx: StepContext, state: dict[str, Any]) -> None:
    state["called"] = True


# Two waits in a row: a signal for the second, sent while the first waits, parks until the second.
two_waits = Workflow("two_waits", version=1)
two_waits.wait("first", signals={"go": "second"}, timeout=timedelta(minutes=10), on_timeout="second", start=True)
two_waits.wait("second", signals={"later": "ended"})


@two_waits.step(next=None)
async def ended(ctx: StepContext, state: dict[str, Any]) -> None:
    assert ctx.signal is not None
    state["via"] = ctx.signal.name


# A task whose priority the state gives, whatever the state holds.
ranked = Workflow("ranked", version=1)
ranked.task("triage", title="Triage", decisions={"done": "$end"}, candidate_groups=["desk"],
            priority=from_state("rank"), start=True)

# A task whose assignee the state names.
named = Workflow("named", version=1)
named.task("answer", title="Answer", decisions={"done": "$end"}, assignee=from_state("who"), start=True)

# A wait correlated by whatever the state holds at `key` (a boolean, a number, a map).
keyed = Workflow("keyed", version=1)
keyed.wait("await_key", messages={"keyed": "$end"}, correlation="key", start=True)

registry = Registry(expense, review, parallel, receipt, callback, two_waits, ranked, named, keyed)
