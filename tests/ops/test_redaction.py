"""The canary: a secret run through every operation never appears in a table (but the live state), a
log line, or what the operations hand out."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Annotated

import asyncpg
import pytest
from pydantic import BaseModel

from stepstone.authoring.sensitive import Sensitive, sensitive_paths
from stepstone.authoring.workflow import Registry, Workflow
from stepstone.core.redaction import REDACTED, Redaction
from stepstone.ops import Operations
from stepstone.testing import Engine, open_engine
from tests.ops import workflows

PIN = "7734-pin-canary"


def test_marked_fields_are_found_nested_and_in_lists() -> None:
    assert sensitive_paths(workflows.Payment) == (("card",), ("holder", "pin"))

    from pydantic import BaseModel  # noqa: PLC0415 - local models for this one test

    class Item(BaseModel):
        token: workflows.Annotated[str, workflows.Sensitive]  # type: ignore[name-defined]

    class Basket(BaseModel):
        items: list[Item] = []
        maybe: Item | None = None

    assert sensitive_paths(Basket) == (("items", "*", "token"), ("maybe", "token"))


def test_patches_and_texts_are_redacted() -> None:
    r = Redaction((("card",), ("holder", "pin")), hook=workflows.mask_tokens)
    ops = [{"op": "replace", "path": "/card", "value": "c-1234"},
           {"op": "add", "path": "/holder", "value": {"name": "Ann", "pin": "9999"}},
           {"op": "replace", "path": "/note", "value": "paid with c-1234 tok_live_x"}]
    out = r.history_data({"patch": ops}, r.secrets({"card": "c-1234", "holder": {"pin": "9999"}}))
    assert out["patch"] == [
        {"op": "replace", "path": "/card", "value": REDACTED},
        {"op": "add", "path": "/holder", "value": {"name": "Ann", "pin": REDACTED}},
        {"op": "replace", "path": "/note", "value": f"paid with {REDACTED} tok_[redacted]_x"},
    ]


async def _all_rows(conn: asyncpg.Connection) -> dict[str, str]:
    """Every row of every table of the schema as text; the live state column left out."""
    out = {}
    for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'stepstone'"):
        table = r["tablename"]
        rows = await conn.fetch(f"SELECT to_jsonb(t) AS j FROM stepstone.{table} t")
        docs = []
        for row in rows:
            doc = row["j"] if isinstance(row["j"], dict) else json.loads(row["j"])
            if table == "instances":
                doc.pop("state", None)
            docs.append(doc)
        out[table] = json.dumps(docs)
    return out


async def test_the_canary_secret_never_leaves_the_live_state(
    engine: Engine, ops: Operations, conn: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = workflows.SECRET
    iid = await engine.client.start(workflows.payment, {"order": "o-1", "card": secret,
                                                         "holder": {"name": "Ann", "pin": PIN}})
    await engine.run_until_idle()  # attempt 1 fails with the card and the pin in its message
    await engine.move_clock(60)
    await engine.run_until_idle()  # attempt 2 changes both: the patch would carry them
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["card"] == secret + "-v2"  # the live state keeps it
    replayed = await ops.cancel([iid])  # ended already: unchanged
    assert replayed.items[0].outcome == "unchanged"
    result = await ops.replay(iid, "charge")
    assert result.state["card"] == REDACTED
    await engine.run_until_idle()
    await engine.move_clock(60)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED"
    assert info.state["card"] == secret + "-v2-v2"  # the replay ran on the real values, not on "[redacted]"

    tables = await _all_rows(conn)
    for table, text in tables.items():
        assert "canary" not in text, f"a sensitive value is stored in {table}"
        assert "tok_live_" not in text, f"the hook's token is stored in {table}"
    history = tables["history"]
    assert REDACTED in history and "tok_[redacted]_abc" in history
    assert "declined for Ann" in history  # the rest of the message is kept
    shown = json.dumps([(await ops.detail(iid)).as_dict(), (await ops.history(iid)).as_dict(),
                        (await ops.find()).as_dict(), (await ops.stuck()).as_dict()], default=str)
    assert "canary" not in shown and "tok_live_" not in shown
    assert "canary" not in caplog.text


async def _cli_outputs(database_url: str, iid: str, child: str) -> str:
    """What the operator CLI prints about the instance and its child, as tables and as JSON."""
    from tests.ops.test_cli_operations import run  # noqa: PLC0415 - the one CLI runner of these tests

    shown = []
    for args in (("inspect", iid), ("inspect", child), ("history", iid, "--limit", "1000"), ("history", child),
                 ("history", iid, "--failed"), ("find",), ("probe", iid), ("stuck",), ("show", iid),
                 ("show", child)):
        for fmt in ((), ("-o", "json")):
            result = await run(database_url, *args, *fmt)
            assert result.exit_code in (0, 3), f"{args}: {result.output}"
            shown.append(result.output)
    return "\n".join(shown)


async def test_the_canary_in_a_signal_payload_and_a_childs_state_stays_out(
    engine: Engine, ops: Operations, conn: asyncpg.Connection, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The signal's payload model marks `otp` sensitive; the child's state marks `card`. The handlers
    get the values (a retry too); no table but the live states, no log line and no output holds them."""
    caplog.set_level(logging.DEBUG)
    iid = await engine.client.start(workflows.confirmed, {"order": "o-7", "card": workflows.SECRET})
    await engine.run_until_idle()
    await engine.client.signal(iid, "otp", {"otp": workflows.OTP, "channel": "sms"})
    await engine.run_until_idle()  # parked: the instance is in its pause, not at the wait
    parked = await conn.fetchval("SELECT payload FROM stepstone.commands WHERE instance_id = $1 AND kind = 'SIGNAL' "
                                 "AND state = 'PARKED'", uuid.UUID(iid))
    assert json.loads(parked)["otp"] == workflows.OTP  # an open command keeps its payload whole
    await engine.move_clock(10)
    await engine.run_until_idle()  # the wait takes the parked signal; attempt 1 of check_otp fails
    await engine.move_clock(60)
    await engine.run_until_idle()  # the retry reads the signal's payload whole, then the child runs
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info
    assert info.state["otp"] == workflows.OTP  # the parent's live state keeps what its handler stored
    assert info.state["from_child"] == REDACTED  # the child's report to its parent held no secret
    child = str(await conn.fetchval("SELECT id FROM stepstone.instances WHERE parent_id = $1", uuid.UUID(iid)))
    assert (await engine.client.get(child)).state["card"] == workflows.SECRET

    tables = await _all_rows(conn)
    for table, text in tables.items():
        assert "canary" not in text, f"a sensitive value is stored in {table}: {text[:400]}"
        assert "tok_live_" not in text, f"the hook's token is stored in {table}"
    assert "otp [redacted] not valid yet tok_[redacted]_def" in tables["history"]
    commands = await conn.fetch("SELECT kind, payload FROM stepstone.commands WHERE instance_id = $1 "
                                "AND kind IN ('SIGNAL', 'STEP', 'CHILD_COMPLETION') AND payload IS NOT NULL",
                                uuid.UUID(iid))
    payloads = [json.loads(r["payload"]) for r in commands]
    assert {"otp": REDACTED, "channel": "sms"} in payloads  # the rest of the payload is kept
    shown = json.dumps([(await ops.detail(i)).as_dict() for i in (iid, child)]
                       + [(await ops.history(i, limit=1000)).as_dict() for i in (iid, child)], default=str)
    shown += await _cli_outputs(database_url, iid, child)
    assert "canary" not in shown and "tok_live_" not in shown
    assert "canary" not in caplog.text


async def test_the_canary_in_a_task_decision_and_a_message_stays_out(
    engine: Engine, ops: Operations, conn: asyncpg.Connection, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The task decision's payload model marks `code` sensitive, the message's marks `ref`: the handlers
    get them; once their commands are settled, the tasks, commands, history and output hold neither."""
    from tests.ops.test_cli_operations import run  # noqa: PLC0415 - the one CLI runner of these tests

    caplog.set_level(logging.DEBUG)
    code, ref = "code-canary-31", "ref-canary-62"
    iid = await engine.client.start(workflows.approval, {"key": "k-1"})
    await engine.run_until_idle()
    (task,) = await engine.client.instance_tasks(iid)
    await engine.client.complete_task(str(task["id"]), "ok", {"code": code, "note": "fine"}, actor="ann")
    await engine.run_until_idle()
    published = await engine.client.publish_message("paid", "k-1", {"ref": ref})
    assert published.outcome == "delivered"
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and (info.state["code"], info.state["ref"]) == (code, ref)

    tables = await _all_rows(conn)
    for table, text in tables.items():  # a delivered message's own row keeps no payload (migration 0020)
        assert "canary" not in text, f"a sensitive value is stored in {table}: {text[:400]}"
    completion = (await engine.client.task(str(task["id"]))).completion
    assert isinstance(completion, dict) and completion["payload"] == {"code": REDACTED, "note": "fine"}
    shown = json.dumps([(await ops.detail(iid)).as_dict(), (await ops.history(iid)).as_dict()], default=str)
    for args in (("tasks", "show", str(task["id"])), ("inspect", iid), ("history", iid)):
        for fmt in ((), ("-o", "json")):
            result = await run(database_url, *args, *fmt)
            assert result.exit_code == 0, f"{args}: {result.output}"
            shown += result.output
    assert "canary" not in shown
    assert "canary" not in caplog.text


async def test_a_buffered_message_keeps_its_payload_only_until_delivered_or_expired(
    engine: Engine, ops: Operations, conn: asyncpg.Connection
) -> None:
    kept = await engine.client.publish_message("paid", "nobody-waits", {"ref": "ref-canary-7"}, ttl=60)
    taken = await engine.client.publish_message("paid", "k-2", {"ref": "ref-canary-8"}, ttl=60)
    assert (kept.outcome, taken.outcome) == ("buffered", "buffered")
    payloads = "SELECT correlation_key, status, payload FROM stepstone.messages ORDER BY id"
    assert [(r["correlation_key"], r["status"], r["payload"] is not None) for r in await conn.fetch(payloads)] == [
        ("nobody-waits", "BUFFERED", True), ("k-2", "BUFFERED", True)]  # the delivery needs it
    iid = await engine.client.start(workflows.approval, {"key": "k-2"})
    await engine.run_until_idle()
    (task,) = await engine.client.instance_tasks(iid)
    await engine.client.complete_task(str(task["id"]), "ok", {"code": "c", "note": ""}, actor="ann")
    await engine.run_until_idle()  # the wait subscribes and takes the buffered message
    assert (await engine.client.get(iid)).status == "COMPLETED"
    await engine.move_clock(61)
    dry = await ops.retention_run(dry_run=True)
    assert dry.messages_expired == 1
    report = await ops.retention_run()
    assert report.messages_expired == 1
    assert [(r["correlation_key"], r["status"], r["payload"]) for r in await conn.fetch(payloads)] == [
        ("nobody-waits", "EXPIRED", None), ("k-2", "DELIVERED", None)]
    assert "canary" not in json.dumps((await _all_rows(conn)), default=str)


async def test_an_instance_in_a_scope_without_its_own_registration_is_redacted_too(
    engine: Engine, ops: Operations, conn: asyncpg.Connection
) -> None:
    """A scope with no registration of its own runs the default scope's: its sensitive paths apply (the
    baseline history and the operator's views read them from the registration the pin was admitted to)."""
    holder = {"name": "Ann", "pin": PIN}
    single = await engine.client.start(workflows.payment, {"order": "o-1", "card": workflows.SECRET,
                                                            "holder": holder}, scope="tenant-a")
    batch = await engine.client.start_many(workflows.payment, [{"order": "o-2", "card": workflows.SECRET,
                                                                "holder": holder}], scope="tenant-a")
    assert await conn.fetchval("SELECT count(*) FROM stepstone.instances WHERE scope = 'tenant-a' "
                               "AND definition_scope = 'default'") == 2
    history = json.dumps([dict(r) for r in await conn.fetch("SELECT data FROM stepstone.history")], default=str)
    assert "canary" not in history and REDACTED in history
    shown = json.dumps([(await ops.detail(iid)).as_dict() for iid in (single, *batch)], default=str)
    assert "canary" not in shown


class _Card(BaseModel):
    order: str
    card: Annotated[str, Sensitive]


card_check: Workflow[_Card] = Workflow("ops_card_check", version=1, state=_Card)
card_check.task("check", title="Check card {card} of order {order}", description="The card is {card}.",
                decisions={"ok": "$end"}, show=("order", "card"), candidate_users=["mia"], start=True)


async def test_a_task_title_that_names_a_sensitive_field_is_stored_redacted(
    database_url: str, conn: asyncpg.Connection,
) -> None:
    """A task's title and description fill `{field}` from the state. Its TASK_OPENED history entry had the
    sensitive value scrubbed, but the task row kept it in both, and every view of the task (the inbox, the
    API, the UI, `stepstone tasks show`) showed it, where the same field among the task's `show` is shown
    redacted. The commit that opens the task now scrubs the title and the description as it scrubs the
    texts of history."""
    card = "4111-title-canary-8"
    async with open_engine(database_url, Registry(card_check)) as engine:
        iid = await engine.client.start(card_check, {"order": "o-7", "card": card})
        await engine.run_until_idle()
        (task,) = await engine.client.instance_tasks(iid)
        info = await engine.client.task(str(task["id"]))
        assert (info.title, info.description) == (f"Check card {REDACTED} of order o-7", f"The card is {REDACTED}.")
        row = await conn.fetchrow("SELECT title, description FROM stepstone.tasks")
        history = await conn.fetchval("SELECT string_agg(data::text, ' ') FROM stepstone.history")
        assert "canary" not in json.dumps([*row.values(), history])


async def test_the_cli_shows_a_tasks_sensitive_fields_redacted(database_url: str) -> None:
    """`stepstone tasks show` and `tasks list` printed the fields a task shows as the task row keeps them, a
    sensitive one whole, where the API, the UI and this page's docs (operations.md, "Output") show it
    redacted. They go through the same redaction as the API's views now."""
    from tests.ops.test_cli_operations import run  # noqa: PLC0415 - the one CLI runner of these tests

    card = "4111-shown-canary-3"
    async with open_engine(database_url, Registry(card_check)) as engine:
        iid = await engine.client.start(card_check, {"order": "o-8", "card": card})
        await engine.run_until_idle()
        (task,) = await engine.client.instance_tasks(iid)
        assert (await engine.client.task(str(task["id"]))).data == {"order": "o-8", "card": card}  # the row
    shown = []
    for args in (("tasks", "show", str(task["id"])), ("tasks", "list", "--mode", "all")):
        for fmt in ((), ("-o", "json")):
            result = await run(database_url, *args, *fmt)
            assert result.exit_code == 0, f"{args}: {result.output}"
            shown.append(result.output)
    assert "canary" not in "\n".join(shown), "\n".join(shown)
    assert "o-8" in "\n".join(shown)
