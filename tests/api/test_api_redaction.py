"""What a workflow marks sensitive is shown redacted by every API and UI view of an instance, its commands,
its history and its tasks, as `stepstone show` and `inspect` show it (docs/operations.md, Redaction)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated

import asyncpg
import httpx
import pytest
from pydantic import BaseModel

from stepstone.api import context_on, create_app
from stepstone.api.tokens import create_token
from stepstone.authoring.sensitive import Sensitive
from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.core.redaction import REDACTED
from stepstone.runtime.serving import record_definitions
from stepstone.store.management import open_management
from stepstone.testing import Engine, open_engine

CARD, OTP, CODE = "4111-card-canary", "otp-canary-77", "code-canary-31"


class Otp(BaseModel):
    otp: Annotated[str, Sensitive]
    channel: str = "sms"


class Approval(BaseModel):
    code: Annotated[str, Sensitive]
    note: str = ""


class Holder(BaseModel):
    name: str
    pin: Annotated[str, Sensitive] = ""


class Payment(BaseModel):
    order: str
    card: Annotated[str, Sensitive]
    holder: Holder
    otp: Annotated[str, Sensitive] = ""
    code: Annotated[str, Sensitive] = ""


payment: Workflow[Payment] = Workflow("api_payment", version=1, state=Payment)
# A signal sent during the pause is parked: its command keeps the payload whole while it is open.
payment.timer("pause", next="await_otp", delay=10, start=True)
payment.wait("await_otp", signals={"otp": "check_otp"}, payloads={"otp": Otp})


@payment.step(next="approve")
def check_otp(ctx: StepContext, state: Payment) -> None:
    assert ctx.signal is not None
    state.otp = ctx.signal.payload["otp"]


payment.task("approve", title="Approve the payment", decisions={"ok": "done"}, payloads={"ok": Approval},
             show=["order", "card", "holder"], candidate_users=["mia"])


@payment.step(next=None)
def done(ctx: StepContext, state: Payment) -> None:
    assert ctx.task is not None
    state.code = ctx.task.payload["code"]


class Signup(BaseModel):
    email: Annotated[str, Sensitive]


# A wait correlated by a sensitive field: its key is that field's value.
signup: Workflow[Signup] = Workflow("api_signup", version=1, state=Signup)
signup.wait("await_confirmation", messages={"confirmed": "welcome"}, correlation="email", start=True)


@signup.step(next=None)
def welcome(ctx: StepContext, state: Signup) -> None:
    pass


registry = Registry(payment, signup)


@pytest.fixture
async def setup(database_url: str) -> AsyncIterator[tuple[Engine, httpx.AsyncClient, dict[str, str]]]:
    async with open_engine(database_url, registry, concurrency=2) as engine:
        ctx = context_on(engine.store, registry=registry)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)),
                                         base_url="http://test") as http:
                token, _ = await create_token(ctx.management, role="admin", scope="*", name="mia")
                yield engine, http, {"Authorization": f"Bearer {token}"}
        finally:
            await ctx.close()


async def _everything(http: httpx.AsyncClient, auth: dict[str, str], iid: str) -> str:
    """Every API view of the instance, its commands, history and tasks, and the UI's instance page."""
    api = "/api/v1"
    shown = []
    for path in (f"/instances/{iid}", f"/instances/{iid}/history?limit=500", f"/instances/{iid}/commands?limit=500",
                 f"/instances/{iid}/children", f"/instances/{iid}/positions", "/tasks?mode=all", "/dead-letters",
                 f"/operator/probe?instance_id={iid}", "/operator/stuck?older_than_seconds=0"):
        response = await http.get(api + path, headers=auth)
        assert response.status_code == 200, (path, response.text)
        shown.append(response.text)
    tasks = [t["id"] for t in (await http.get(f"{api}/tasks?mode=all", headers=auth)).json()["items"]]
    shown.extend([(await http.get(f"{api}/tasks/{t}", headers=auth)).text for t in tasks])
    await http.post("/ui/login", data={"token": auth["Authorization"].removeprefix("Bearer ")})
    page = await http.get(f"/ui/instances/{iid}")
    assert page.status_code == 200
    shown.append(page.text)
    shown.extend([(await http.get(f"/ui/tasks/{t}")).text for t in tasks])
    return "\n".join(shown)


async def test_no_view_of_the_api_or_the_ui_shows_a_sensitive_value(
    setup: tuple[Engine, httpx.AsyncClient, dict[str, str]],
) -> None:
    engine, http, auth = setup
    started = await http.post("/api/v1/instances", headers=auth, json={"workflow": "api_payment", "input": {
        "order": "o-1", "card": CARD, "holder": {"name": "Ann", "pin": "pin-canary-5"}}})
    assert started.status_code == 201, started.text
    iid = started.json()["id"]
    await engine.run_until_idle()
    sent = await http.post(f"/api/v1/instances/{iid}/signals", headers=auth,
                           json={"name": "otp", "payload": {"otp": OTP, "channel": "sms"}})
    assert sent.status_code == 202, sent.text
    await engine.run_until_idle()  # parked during the pause: its open command holds the payload whole
    shown = await _everything(http, auth, iid)
    assert "canary" not in shown

    state = (await http.get(f"/api/v1/instances/{iid}", headers=auth)).json()["state"]
    assert state["card"] == REDACTED and state["holder"] == {"name": "Ann", "pin": REDACTED}
    commands = (await http.get(f"/api/v1/instances/{iid}/commands", headers=auth)).json()["items"]
    assert {"otp": REDACTED, "channel": "sms"} in [c["payload"] for c in commands]  # the rest is kept

    await engine.advance(10)
    await engine.run_until_idle()  # the wait takes the signal; the task opens, showing the card
    (task,) = (await http.get("/api/v1/tasks?mode=all", headers=auth)).json()["items"]
    assert task["data"]["card"] == REDACTED and task["data"]["order"] == "o-1"
    completed = await http.post(f"/api/v1/tasks/{task['id']}/complete", headers=auth,
                                json={"decision": "ok", "payload": {"code": CODE, "note": "fine"}})
    assert completed.status_code == 202, completed.text
    assert "canary" not in completed.text
    shown = await _everything(http, auth, iid)  # the completion's command is open: its payload whole
    assert "canary" not in shown
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and (info.state["otp"], info.state["code"]) == (OTP, CODE)
    shown = await _everything(http, auth, iid)
    assert "canary" not in shown, json.dumps(shown)[:2000]


async def test_a_version_recorded_without_its_payload_paths_gets_them_when_a_worker_records_it(
    setup: tuple[Engine, httpx.AsyncClient, dict[str, str]], conn: asyncpg.Connection,
) -> None:
    """A version registered before the registration document kept the payload models' paths: its open
    signal's payload shows whole until a worker of this release records the version again (at start)."""
    engine, http, auth = setup
    iid = await engine.client.start(payment, {"order": "o-2", "card": CARD, "holder": {"name": "Ann"}})
    await engine.run_until_idle()
    await conn.execute("UPDATE stepstone.definitions SET plan = plan - 'sensitive_payloads'")
    await engine.client.signal(iid, "otp", {"otp": OTP})
    await engine.run_until_idle()  # parked
    shown = (await http.get(f"/api/v1/instances/{iid}/commands", headers=auth)).json()["items"]
    assert OTP in json.dumps(shown)
    await record_definitions(engine.store.definitions, registry)
    assert "canary" not in (await http.get(f"/api/v1/instances/{iid}/commands", headers=auth)).text
    assert "canary" not in (await http.get(f"/api/v1/instances/{iid}", headers=auth)).text


async def test_a_refused_completion_shows_the_winners_payload_redacted(
    setup: tuple[Engine, httpx.AsyncClient, dict[str, str]],
) -> None:
    """A completion refused because another one won (TaskNotOpen, 409) carries the winning completion, so the
    caller learns who decided what; its payload came whole, a sensitive field included, where every view of
    the task shows it redacted. The 409 body shows it redacted now."""
    engine, http, auth = setup
    iid = await engine.client.start(payment, {"order": "o-3", "card": CARD, "holder": {"name": "Ann"}})
    await engine.run_until_idle()
    await engine.client.signal(iid, "otp", {"otp": OTP})
    await engine.advance(10)
    await engine.run_until_idle()
    (task,) = (await http.get("/api/v1/tasks?mode=all", headers=auth)).json()["items"]
    won = await http.post(f"/api/v1/tasks/{task['id']}/complete", headers=auth,
                          json={"decision": "ok", "payload": {"code": CODE, "note": "fine"}})
    assert won.status_code == 202, won.text
    for _ in range(2):  # while the completion is pending (COMPLETING), then once it completed
        again = await http.post(f"/api/v1/tasks/{task['id']}/complete", headers=auth,
                                json={"decision": "ok", "payload": {"code": "other", "note": "late"}})
        assert again.status_code == 409, again.text
        body = again.json()
        assert body["error"] == "TaskNotOpen" and body["completion"]["actor"] == "mia"
        assert body["completion"]["payload"] == {"code": REDACTED, "note": "fine"}
        assert "canary" not in again.text
        await engine.run_until_idle()
    assert (await engine.client.get(iid)).state["code"] == CODE


async def test_a_refusal_naming_an_open_completion_shows_its_payload_redacted(
    setup: tuple[Engine, httpx.AsyncClient, dict[str, str]],
) -> None:
    """A task refused because it is being completed (409 TaskNotOpen) names the completion that won, which the
    task row keeps whole until its command settles: the problem shows it as the task's views do, to whoever
    tried (here another candidate, who never saw the code)."""
    engine, http, auth = setup
    started = await http.post("/api/v1/instances", headers=auth, json={"workflow": "api_payment", "input": {
        "order": "o-3", "card": CARD, "holder": {"name": "Ann"}}})
    iid = started.json()["id"]
    await engine.run_until_idle()
    await engine.client.signal(iid, "otp", {"otp": OTP})
    await engine.advance(10)
    await engine.run_until_idle()
    (task,) = (await http.get("/api/v1/tasks?mode=all", headers=auth)).json()["items"]
    done = await http.post(f"/api/v1/tasks/{task['id']}/complete", headers=auth,
                           json={"decision": "ok", "payload": {"code": CODE, "note": "fine"}})
    assert done.status_code == 202, done.text
    token, _ = await create_token(open_management(engine.store), role="task_worker", name="bob")
    bob = {"Authorization": f"Bearer {token}"}
    for action, body in (("complete", {"decision": "ok", "payload": {"code": "mine"}}), ("claim", None),
                         ("reassign", {"to": "eve", "admin": True})):
        refused = await http.post(f"/api/v1/tasks/{task['id']}/{action}", headers=auth if action == "reassign" else bob,
                                  json=body)
        assert (refused.status_code, refused.json()["error"]) == (409, "TaskNotOpen"), refused.text
        assert refused.json()["completion"]["payload"] == {"code": REDACTED, "note": "fine"}, action


async def test_the_cli_shows_a_task_as_the_api_does(
    setup: tuple[Engine, httpx.AsyncClient, dict[str, str]], database_url: str,
) -> None:
    """`stepstone tasks show`, `list` and `complete`, as tables and with -o json, redact the state fields a task
    shows and its open completion's payload as the API does (docs/operations.md: `tasks show` is among the
    outputs that redact); they printed the task row as stored."""
    from tests.ops.test_cli_operations import run  # noqa: PLC0415 - the one CLI runner of the operator tests

    engine, http, auth = setup
    iid = await engine.client.start(payment, {"order": "o-4", "card": CARD, "holder": {"name": "Ann", "pin": "p"}})
    await engine.run_until_idle()
    await engine.client.signal(iid, "otp", {"otp": OTP})
    await engine.advance(10)
    await engine.run_until_idle()
    (task,) = (await http.get("/api/v1/tasks?mode=all", headers=auth)).json()["items"]
    shown = []
    for args in (("tasks", "show", task["id"]), ("tasks", "list", "--mode", "all"),
                 ("tasks", "complete", task["id"], "ok", "--payload", json.dumps({"code": CODE}), "--as", "mia",
                  "--idempotency-key", "k-4"),  # the second time, a repeat
                 ("tasks", "show", task["id"])):  # the completion's command is open: the row holds the code whole
        for fmt in ((), ("-o", "json")):
            result = await run(database_url, *args, *fmt)
            assert result.exit_code == 0, result.output
            shown.append(result.output)
    assert "canary" not in "\n".join(shown)
    data = json.loads(shown[-1])
    assert (data["data"]["card"], data["completion"]["payload"]) == (REDACTED, {"code": REDACTED})


async def test_a_waits_correlation_key_read_from_a_sensitive_field_is_redacted(
    setup: tuple[Engine, httpx.AsyncClient, dict[str, str]], database_url: str,
) -> None:
    """`correlation="email"` on a sensitive email: what the instance waits for (its `waiting_for` and its
    position's `wait`) named the address whole beside the state's [redacted], in the API, the UI, `show` and
    `inspect`."""
    from tests.ops.test_cli_operations import run  # noqa: PLC0415 - the one CLI runner of the operator tests

    engine, http, auth = setup
    address = "ann-canary@example.org"
    iid = await engine.client.start(signup, {"email": address})
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).waiting_for["correlation_key"] == address  # the live row keeps it
    shown = (await http.get(f"/api/v1/instances/{iid}", headers=auth)).json()
    assert (shown["waiting_for"]["correlation_key"], shown["positions"][0]["wait"]["correlation_key"]) == (
        REDACTED, REDACTED)
    assert shown["waiting_for"]["messages"] == {"confirmed": "welcome"}  # the rest of the wait is kept
    texts = [(await http.get(f"/api/v1/instances/{iid}/positions", headers=auth)).text]
    await http.post("/ui/login", data={"token": auth["Authorization"].removeprefix("Bearer ")})
    texts.append((await http.get(f"/ui/instances/{iid}")).text)
    for args in (("show", iid), ("inspect", iid)):
        for fmt in ((), ("-o", "json")):
            result = await run(database_url, *args, *fmt)
            assert result.exit_code == 0, result.output
            texts.append(result.output)
    assert "canary" not in "\n".join(texts)
    published = await engine.client.publish_message("confirmed", address)  # the key still correlates
    assert published.outcome == "delivered"


async def test_an_instance_named_by_another_spelling_of_its_id_is_redacted_all_the_same(
    setup: tuple[Engine, httpx.AsyncClient, dict[str, str]],
) -> None:
    """Any spelling of a UUID finds the instance (upper case, no hyphens, braces, urn:uuid:); the redaction was
    looked up by the id as typed among ids spelled the database's way, so such a spelling found none and showed
    the state and an open signal's payload whole."""
    engine, http, auth = setup
    iid = await engine.client.start(payment, {"order": "o-5", "card": CARD, "holder": {"name": "Ann", "pin": "p"}})
    await engine.run_until_idle()
    await engine.client.signal(iid, "otp", {"otp": OTP})
    await engine.run_until_idle()  # parked during the pause: its open command holds the payload whole
    await http.post("/ui/login", data={"token": auth["Authorization"].removeprefix("Bearer ")})
    for spelling in (iid.upper(), iid.replace("-", ""), "{" + iid + "}", "urn:uuid:" + iid):
        for path in (f"/api/v1/instances/{spelling}", f"/api/v1/instances/{spelling}/commands",
                     f"/ui/instances/{spelling}"):
            r = await http.get(path, headers=auth if path.startswith("/api") else {})
            assert r.status_code == 200, (path, r.text[:200])
            assert "canary" not in r.text, path
