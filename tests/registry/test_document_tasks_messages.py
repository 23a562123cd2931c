"""Documents describe human tasks and message waits like code does, and run them end to end."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from stepstone.authoring.documents import Catalog, load_document
from stepstone.authoring.workflow import Registry, StepContext, Workflow, from_state
from stepstone.errors import DocumentInvalid, InvalidInput
from stepstone.ops.definitions import load_published, publish_document
from stepstone.runtime.worker import Worker
from stepstone.testing import open_engine


class Approval(BaseModel):
    note: str


catalog = Catalog()
catalog.model("approval_note", Approval)


@catalog.handler("ship")
def ship(ctx: StepContext, state: dict[str, Any]) -> None:
    state["shipped"] = ctx.workflow


REFUND = """\
id: refund
version: 1
steps:
  - name: decide
    kind: task
    start: true
    title: Approve the refund
    assignee: {state: manager}
    candidate_groups: [finance]
    priority: 70
    show: [amount]
    decisions: {approve: await_payment, reject: $end}
    payloads: {approve: approval_note}
  - name: await_payment
    kind: wait
    messages: {payment_settled: ship}
    correlation: order
    timeout: 86400
    on_timeout: $end
  - name: ship
    kind: action
    handler: ship
"""


def _same_in_code() -> Workflow[Any]:
    wf: Workflow[Any] = Workflow("refund", version=1)
    wf.task("decide", title="Approve the refund", assignee=from_state("manager"), candidate_groups=["finance"],
            priority=70, show=["amount"], decisions={"approve": "await_payment", "reject": "$end"},
            payloads={"approve": Approval}, start=True)
    wf.wait("await_payment", messages={"payment_settled": "ship"}, correlation="order", timeout=86400,
            on_timeout="$end")
    wf.step(name="ship")(ship)
    return wf


def test_a_task_and_a_message_wait_in_a_document_make_the_plan_code_makes() -> None:
    wf = load_document(REFUND, catalog)
    assert wf.plan.plan_hash == _same_in_code().plan.plan_hash
    decide, wait = wf.plan.steps["decide"], wf.plan.steps["await_payment"]
    assert (decide.kind, dict(decide.decisions)) == ("task", {"approve": "await_payment", "reject": "$end"})
    assert (wait.kind, dict(wait.messages), wait.correlation) == ("wait", {"payment_settled": "ship"}, "order")


@pytest.mark.parametrize(("edit", "message"), [
    (("payloads: {approve: approval_note}", "payloads: {approve: missing_model}"),
     "line 13, column 25 (steps[0].payloads.approve): unknown payload model 'missing_model'"),
    (("payloads: {approve: approval_note}", "payloads: {maybe: approval_note}"),
     "(steps[0].payloads.maybe): payload for 'maybe', which is not one of the task's decisions"),
    (("    correlation: order\n", ""), "(steps[1]): 'correlation' is a dependency of 'messages'"),
    (("    title: Approve the refund\n", ""), "(steps[0]): 'title' is a required property"),
    (("priority: 70", "priority: high"), "line 10, column 15 (steps[0].priority)"),
])
def test_bad_task_and_message_fields_name_their_place(edit: tuple[str, str], message: str) -> None:
    with pytest.raises(DocumentInvalid) as err:
        load_document(REFUND.replace(*edit), catalog)
    assert message in str(err.value)


async def test_a_published_document_with_a_task_and_a_message_wait_runs_end_to_end(database_url: str) -> None:
    async with open_engine(database_url, Registry()) as engine:
        published = await publish_document(engine.store.definitions, REFUND, catalog)
        assert published.status == "AVAILABLE"
        registry = Registry(*await load_published(engine.store.definitions, catalog))
        client = type(engine.client)(engine.store, registry)
        worker = Worker(engine.store, registry)
        iid = await client.start("refund", {"manager": "maria", "order": "o-7", "amount": 12})
        await worker.run_until_idle()
        [task] = await client.instance_tasks(iid)
        info = await client.task(str(task["id"]))
        assert (info.assignee, info.title, info.status) == ("maria", "Approve the refund", "OPEN")
        with pytest.raises(InvalidInput):  # the document's payload model checks the decision's payload
            await client.complete_task(info.id, "approve", {"no_note": 1}, actor="maria")
        await client.complete_task(info.id, "approve", {"note": "fine"}, actor="maria")
        await worker.run_until_idle()
        assert (await client.get(iid)).step == "await_payment"
        delivered = await client.publish_message("payment_settled", "o-7", {"paid": 12})
        assert delivered.outcome == "delivered"
        await worker.run_until_idle()
        done = await client.get(iid)
        assert (done.status, done.state["shipped"]) == ("COMPLETED", "refund")


@pytest.mark.parametrize("field", ["due", "follow_up", "reminder", "expire"])
def test_a_task_date_past_a_thousand_years_is_refused_under_the_documents_field_name(field: str) -> None:
    """A reminder or an expiry was refused as `reminder_seconds` or `expire_seconds`, names no document (and
    no Python declaration) uses."""
    extra = ", on_expire: $end" if field == "expire" else ""
    text = (f"id: t\nversion: 1\nsteps:\n  - {{name: a, kind: task, start: true, title: T, decisions: {{ok: $end}}, "
            f"{field}: 40000000000{extra}}}\n")
    with pytest.raises(DocumentInvalid, match=f"task step 'a': {field} must be at most a thousand years"):
        load_document(text, None)


def test_a_priority_out_of_range_is_told_it_may_be_read_from_the_state() -> None:
    with pytest.raises(DocumentInvalid) as err:
        load_document(REFUND.replace("priority: 70", "priority: 99999999999"), catalog)
    assert str(err.value).endswith("2,147,483,647 (or read from the state), got 99999999999"), str(err.value)
