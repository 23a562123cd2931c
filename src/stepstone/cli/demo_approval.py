"""``stepstone demo approval``: an expense approval with a candidate group, a reminder, an escalation
after the due date, and a correlated "receipt received" message.

The demo plays the people: nobody of `approvers` acts, so the task reminds and then escalates to
`finance-leads`, where `lee` claims and approves it; then the receipt arrives as a message correlated
by the expense id. Every line about the expense comes from the instance's committed history.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Any

import click

from stepstone.cli.common import CliError, run_async, with_settings
from stepstone.cli.connection import open_store
from stepstone.client import SETTLED, Client
from stepstone.config import Settings
from stepstone.core.attribution import Actor
from stepstone.core.model import COMPLETED
from stepstone.examples import approval
from stepstone.runtime.worker import Worker, WorkerConfig

_DEADLINE = 60.0
_LEAD = "lee"

_SAID = {
    "INSTANCE_STARTED": "submitted",
    "TASK_OPENED": "task opened for group approvers",
    "TASK_REMINDED": "reminder sent (nobody acted yet)",
    "TASK_ESCALATED": "due date passed: escalated to group finance-leads",
    "TASK_CLAIMED": "task claimed",
    "TASK_COMPLETION_RECORDED": "decision recorded",
    "TASK_COMPLETED": "task completed",
    "MESSAGE_CORRELATED": "receipt message correlated",
    "INSTANCE_COMPLETED": "instance completed",
}


def _narrate(entry: dict[str, Any]) -> str | None:
    said = _SAID.get(str(entry["kind"]))
    if said is None:
        return None
    actor = Actor.parse(entry.get("actor"))
    who = f" by {actor.id}" if actor is not None and actor.kind != "worker" else ""  # people, not workers
    return said + who


async def run_approval(client: Client, worker: Worker) -> None:
    expense_id = f"x-{secrets.token_hex(3)}"
    tag = f"[expense {expense_id}]"
    iid = await client.start(approval.approval, approval.Expense(expense_id=expense_id, employee="eve", amount=84.5))
    click.echo(f"{tag} instance {iid}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _DEADLINE
    printed, approved, receipt_to = 0, False, None
    while True:
        seen = worker.events.commits
        info = await client.get(iid)
        history = await client.history(iid)
        for entry in history[printed:]:
            line = _narrate(entry)
            if line:
                click.echo(f"{tag} {line}")
        printed = len(history)
        kinds = {h["kind"] for h in history}
        if info.status in SETTLED:
            break
        if "TASK_ESCALATED" in kinds and not approved:
            [task] = (await client.tasks(user=_LEAD, groups=["finance-leads"])).tasks
            await client.claim_task(task.id, actor=_LEAD, groups=["finance-leads"])
            await client.complete_task(task.id, "approve", {"comment": "ok after escalation"}, actor=_LEAD,
                                       groups=["finance-leads"], idempotency_key=f"{expense_id}/approve")
            approved = True
        if info.step == "await_receipt" and receipt_to is None:
            published = await client.publish_message("receipt_received", expense_id, {"receipt_id": f"r-{expense_id}"},
                                                     message_id=f"receipt/{expense_id}")
            click.echo(f"{tag} published receipt_received: {published.outcome}")
            receipt_to = published.deliveries[0].instance_id if published.deliveries else "nobody"
        if loop.time() >= deadline:
            raise CliError(f"{tag} is still {info.status} at {info.step} after {_DEADLINE:g} s")
        with contextlib.suppress(TimeoutError):
            await worker.events.wait_until(lambda: worker.events.commits > seen,  # noqa: B023 - used at once
                                           timeout=max(0.01, min(0.2, deadline - loop.time())))
    if info.status != COMPLETED or info.state["status"] != "APPROVED":
        raise CliError(f"{tag} ended {info.status} ({info.state.get('status')}): {info.error}")
    escalated = "after escalation" if "TASK_ESCALATED" in kinds else "without escalation"
    click.echo(f"approval: {info.state['status']} by {info.state['approved_by']} {escalated}; "
               f"receipt correlated to {receipt_to}")


async def _demo_approval(settings: Settings) -> None:
    from stepstone.cli.demo import _migrate  # noqa: PLC0415 - demo imports this module's command

    click.echo(await _migrate(settings))
    async with open_store(settings) as store:
        worker = Worker(store, approval.registry, WorkerConfig(concurrency=2, poll_interval=0.1))
        await worker.start()
        client = Client(store, approval.registry)
        try:
            await run_approval(client, worker)
        finally:
            await client.detach()
            await worker.stop(drain_timeout=5.0)


@click.command("approval")
@with_settings
def demo_approval_command(settings: Settings) -> None:
    """An expense approval: a group task that reminds, escalates when due, and a correlated receipt message."""
    run_async(_demo_approval(settings))
