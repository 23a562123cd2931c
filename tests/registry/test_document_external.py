"""Documents describe external steps (and deadlines, compensations, wait payloads) with the same
authoring calls code makes: equal plans, errors with their place, and a published one runs end to end."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import pytest
from click.testing import CliRunner
from pydantic import BaseModel

from stepstone.authoring.documents import Catalog, load_document
from stepstone.authoring.sensitive import Sensitive
from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow
from stepstone.cli import cli
from stepstone.errors import DocumentInvalid
from stepstone.external import ExternalTasks
from stepstone.ops.definitions import load_published
from stepstone.runtime.worker import Worker
from stepstone.testing import open_engine
from tests.external.workflows import begin, declined, payment, receipt

catalog = Catalog()
catalog.add("begin", begin)
catalog.add("receipt", receipt)
catalog.add("declined", declined)

# tests/external/workflows.py's `payment`, written as a document
PAYMENT = """\
id: payment
version: 1
steps:
  - name: begin
    kind: action
    handler: begin
    start: true
    next: charge
  - name: charge
    kind: external
    topic: payments
    next: receipt
    inputs: [order_id, amount]
    errors: {card_declined: declined}
    retry: {max_attempts: 3, backoff: 10, multiplier: 2}
  - name: receipt
    kind: action
    handler: receipt
  - name: declined
    kind: action
    handler: declined
"""


def test_an_external_step_in_a_document_makes_the_plan_code_makes() -> None:
    wf = load_document(PAYMENT, catalog)
    assert wf.plan.plan_hash == payment.plan.plan_hash
    assert wf.plan.document() == payment.plan.document()
    assert wf.registration_document() == payment.registration_document()
    assert load_document(PAYMENT, None).plan.plan_hash == payment.plan.plan_hash  # handlers are not structure
    charge = wf.plan.steps["charge"]
    assert (charge.kind, charge.topic, charge.inputs, dict(charge.errors), charge.retry.initial_backoff) == (
        "external", "payments", ("order_id", "amount"), {"card_declined": "declined"}, 10.0)


def test_every_external_option_enters_the_plan() -> None:
    base = load_document(PAYMENT, catalog).plan.plan_hash
    for edits in [[("topic: payments", "topic: cards")],
                  [("next: receipt", "next: declined"), ("{card_declined: declined}", "{card_declined: receipt}")],
                  [("inputs: [order_id, amount]", "inputs: [order_id]")],
                  [("errors: {card_declined: declined}", "errors: {card_declined: declined, fraud: $end}")],
                  [("backoff: 10", "backoff: 11")], [("max_attempts: 3", "max_attempts: 4")],
                  [("multiplier: 2}", "multiplier: 2, max_backoff: 30}")], [("multiplier: 2}", "multiplier: 3}")]]:
        text = PAYMENT
        for edit in edits:
            assert edit[0] in text
            text = text.replace(*edit)
        assert load_document(text, catalog).plan.plan_hash != base, edits
    whole_state = PAYMENT.replace("    inputs: [order_id, amount]\n", "")
    code: Workflow[Any] = Workflow("payment", version=1)
    code.step(start=True, next="charge")(begin)
    code.external("charge", topic="payments", next="receipt", errors={"card_declined": "declined"},
                  retry=Retry(max_attempts=3, backoff=10, multiplier=2))
    code.step(receipt)
    code.step(declined)
    assert load_document(whole_state, catalog).plan.plan_hash == code.plan.plan_hash


@pytest.mark.parametrize(("edit", "line", "column", "path", "words"), [
    (("    topic: payments\n", "    topic: payments\n    lock: 60\n"), 12, 5, "steps[1].lock", "unknown field 'lock'"),
    (("    topic: payments\n", ""), 9, 5, "steps[1]", "'topic' is a required property"),
    (("next: receipt", "next: reciept"), 12, 11, "steps[1].next", "goes to unknown step 'reciept'"),
    (("next: receipt", "next: [receipt]"), 12, 11, "steps[1].next", "is not of type 'string'"),
    (("    next: receipt\n", ""), 9, 5, "steps[1]", "'next' is a required property"),
    (("{card_declined: declined}", "{card_declined: nowhere}"), 14, 29, "steps[1].errors.card_declined",
     "goes to unknown step 'nowhere'"),
    (("topic: payments", "topic: 'pay ments'"), 11, 12, "steps[1].topic", "does not match"),
    (("inputs: [order_id, amount]", "inputs: [order_id, '']"), 13, 24, "steps[1].inputs[1]", "should be non-empty"),
    (("max_attempts: 3", "max_attempts: 0"), 15, 27, "steps[1].retry.max_attempts", "less than the minimum"),
    (("retry: {max_attempts: 3", "retry: {tries: 3, max_attempts: 3"), 15, 13, "steps[1].retry.tries",
     "unknown field 'tries'"),
])
def test_a_bad_external_step_names_its_line_column_and_path(
    edit: tuple[str, str], line: int, column: int, path: str, words: str
) -> None:
    text = PAYMENT.replace(*edit)
    assert text != PAYMENT
    with pytest.raises(DocumentInvalid) as raised:
        load_document(text, catalog)
    err = raised.value
    assert (err.line, err.column, err.path) == (line, column, path), str(err)
    assert words in str(err) and str(err).startswith(f"line {line}, column {column} ")


def test_the_same_errors_in_json() -> None:
    doc = {"id": "payment", "version": 1, "steps": [
        {"name": "charge", "kind": "external", "start": True, "next": "$end"}]}
    with pytest.raises(DocumentInvalid, match=r"^line 1, column \d+ \(steps\[0\]\): 'topic' is a required"):
        load_document(json.dumps(doc), catalog, fmt="json")
    doc["steps"][0]["topic"] = "payments"
    assert load_document(json.dumps(doc), catalog, fmt="json").plan.steps["charge"].topic == "payments"


# -- the other additions: step deadlines, compensations, wait payloads, the workflow's deadline -----


class Card(BaseModel):
    number: Annotated[str, Sensitive]


undo_calls: list[Any] = []


@catalog.handler("reserve")
def reserve(ctx: StepContext, state: dict[str, Any]) -> None:
    ctx.record({"held": True})


@catalog.handler("release")
def release(_ctx: Any, _state: Any, recorded: Any) -> None:
    undo_calls.append(recorded)


catalog.model("card", Card)

SAGA = """\
id: booking
version: 2
deadline: 3600
steps:
  - name: reserve
    kind: action
    handler: reserve
    start: true
    next: pause
    retry: {max_attempts: 2}
    deadline: 30
    on_deadline: $end
    compensation: {handler: release, retry: {max_attempts: 5, backoff: 2}}
  - name: pause
    kind: timer
    delay: 5
    next: card
    deadline: 10
  - name: card
    kind: wait
    signals: {card_given: $end}
    payloads: {card_given: card}
    deadline: 600
    on_deadline: $end
"""


def _saga_in_code() -> Workflow[Any]:
    wf: Workflow[Any] = Workflow("booking", version=2, deadline=3600)
    wf.step(name="reserve", start=True, next="pause", retry=Retry(max_attempts=2), deadline=30,
            on_deadline="$end")(reserve)
    wf.compensation("reserve", retry=Retry(max_attempts=5, backoff=2), name="release")(release)
    wf.timer("pause", delay=5, next="card", deadline=10)
    wf.wait("card", signals={"card_given": "$end"}, payloads={"card_given": Card}, deadline=600, on_deadline="$end")
    return wf


def test_deadlines_compensations_and_wait_payloads_in_a_document_match_code() -> None:
    wf, code = load_document(SAGA, catalog), _saga_in_code()
    assert wf.plan.plan_hash == code.plan.plan_hash
    assert wf.registration_document() == code.registration_document()
    assert wf.redaction == code.redaction
    assert wf.redaction.payload_paths(("signal", "card_given")) == (("number",),)  # the catalog model's mark
    assert wf.deadline == code.deadline == 3600.0
    assert wf.compensation_handler("reserve") is release
    reserve_step = wf.plan.steps["reserve"]
    assert reserve_step.compensation is not None and reserve_step.compensation.name == "release"
    assert (reserve_step.deadline_seconds, reserve_step.on_deadline) == (30.0, "$end")


@pytest.mark.parametrize(("edit", "words"), [
    (("    deadline: 10\n", "    on_deadline: $end\n"), "(steps[1]): 'deadline' is a dependency of 'on_deadline'"),
    (("handler: release", "handler: relese"),
     "line 13, column 29 (steps[0].compensation.handler): unknown handler 'relese'"),
    (("compensation: {handler: release,", "compensation: {"), "(steps[0].compensation): 'handler' is a required"),
    (("payloads: {card_given: card}", "payloads: {card_taken: card}"),
     "line 22, column 28 (steps[2].payloads.card_taken): payload for 'card_taken', which is none of the wait's"),
    (("payloads: {card_given: card}", "payloads: {card_given: cart}"),
     "line 22, column 28 (steps[2].payloads.card_given): unknown payload model 'cart'"),
    (("on_deadline: $end\n    compensation", "on_deadline: paws\n    compensation"),
     "line 12, column 18 (steps[0].on_deadline): step 'reserve' goes to unknown step 'paws'"),
    (("deadline: 3600", "deadline: -1"), "line 3, column 11 (deadline): -1 is less than the minimum"),
])
def test_bad_deadlines_compensations_and_payloads_name_their_place(edit: tuple[str, str], words: str) -> None:
    text = SAGA.replace(*edit)
    assert text != SAGA
    with pytest.raises(DocumentInvalid) as raised:
        load_document(text, catalog)
    assert words in str(raised.value)


# -- end to end against PostgreSQL --------------------------------------------------------------


async def test_a_published_document_with_an_external_step_runs_end_to_end(database_url: str, tmp_path: Path) -> None:
    doc = tmp_path / "payment.yaml"
    doc.write_text(PAYMENT)
    published = await asyncio.to_thread(  # the command runs its own event loop
        CliRunner().invoke, cli, ["definitions", "publish", str(doc), "--catalog",
                                  "tests.registry.test_document_external:catalog", "--database-url", database_url])
    assert published.exit_code == 0, published.output
    assert published.stdout.startswith(f"published payment v1 (scope default, plan {payment.plan.plan_hash[:12]}")
    async with open_engine(database_url, Registry()) as engine:
        registry = Registry(*await load_published(engine.store.definitions, catalog))
        [wf] = list(registry)
        assert (wf.plan.plan_hash, type(wf).__name__) == (payment.plan.plan_hash, "DocumentWorkflow")
        client = type(engine.client)(engine.store, registry)
        worker = Worker(engine.store, registry)
        tasks = ExternalTasks(engine.store, poll_interval=0.05)
        try:
            paid = await client.start("payment", {"order_id": "A-7", "amount": 30, "note": "not sent"})
            refused = await client.start("payment", {"order_id": "A-8", "amount": 99})
            await worker.run_until_idle()
            assert (await client.get(paid)).waiting_for["kind"] == "external"
            locked = {t.instance_id: t for t in await tasks.fetch_and_lock("w1", ["payments"], max_tasks=5)}
            assert set(locked) == {paid, refused}
            assert locked[paid].payload == {"order_id": "A-7", "amount": 30}  # only the document's inputs
            assert (locked[paid].step, locked[paid].retries) == ("charge", 3)
            await tasks.complete(locked[paid].id, locked[paid].lock_token, {"charge_id": "ch-7"}, worker_id="w1")
            await tasks.raise_error(locked[refused].id, locked[refused].lock_token, "card_declined", "no funds")
            await worker.run_until_idle()
        finally:
            await tasks.close()
        done, declined_one = await client.get(paid), await client.get(refused)
        assert (done.status, done.state["receipt"]) == ("COMPLETED", "A-7 paid with ch-7")
        assert (declined_one.status, declined_one.state["declined"]) == ("COMPLETED", True)
        assert declined_one.state["why"]["code"] == "card_declined"
