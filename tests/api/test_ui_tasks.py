"""The UI's task inbox through httpx: claim, a completion form generated from the decision's schema,
a wrong value shown on the form, delegate; and the form generator on its own."""

from __future__ import annotations

import re

from stepstone.ui.task_form import decisions_of, payload_of
from tests.api.conftest import Api
from tests.api.workflows import Approval


async def _sign_in(api: Api, name: str, role: str = "task_worker") -> str:
    token = (await api.token(role, name=name))["Authorization"].removeprefix("Bearer ")
    assert (await api.http.post("/ui/login", data={"token": token})).status_code == 303
    page = await api.http.get("/ui/tasks")
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
    assert found
    return found.group(1)


async def _expense(api: Api, employee: str) -> tuple[str, str]:
    iid = await api.engine.client.start("expense", {"employee": employee, "amount": 75})
    await api.engine.run_until_idle()
    [task] = await api.engine.client.instance_tasks(iid)
    return iid, str(task["id"])


async def test_claim_from_the_inbox_then_complete_with_the_generated_form(api: Api) -> None:
    iid, tid = await _expense(api, "ann")
    csrf = await _sign_in(api, "mia")
    inbox = (await api.http.get("/ui/tasks")).text
    assert "Approve ann&#39;s expense" in inbox and f'action="/ui/tasks/{tid}/claim"' in inbox
    assert re.search(r'id="task-count">1<', inbox)
    r = await api.http.post(f"/ui/tasks/{tid}/claim", data={"csrf": csrf})
    assert (r.status_code, r.headers["location"].split("&sig=")[0]) == (
        303, f"/ui/tasks/{tid}?done=claimed+{tid[:8]}")
    page = (await api.http.get(f"/ui/tasks/{tid}")).text
    assert 'id="task-assignee">mia<' in page
    assert 'name="f.comment"' in page and re.search(r'name="f.approved_amount"[^>]*type="number"[^>]*required', page)
    assert 'data-decision="reject"' in page

    r = await api.http.post(f"/ui/tasks/{tid}/complete",
                            data={"csrf": csrf, "decision": "approve", "f.comment": "ok", "f.approved_amount": "x"})
    assert r.status_code == 422
    assert "must be a number" in r.text and 'value="ok"' in r.text  # what was typed stays in the form
    assert (await api.engine.client.task(tid)).status == "OPEN"
    r = await api.http.post(f"/ui/tasks/{tid}/complete",
                            data={"csrf": csrf, "decision": "approve", "f.comment": "ok", "f.approved_amount": "70"})
    assert r.status_code == 303
    await api.engine.run_until_idle()
    state = (await api.engine.client.get(iid)).state
    assert (state["outcome"], state["comment"]) == ("paid by mia", "ok")


async def test_delegate_from_the_task_page_and_a_stale_form_is_refused(api: Api) -> None:
    _, tid = await _expense(api, "ben")
    csrf = await _sign_in(api, "mia")
    await api.http.post(f"/ui/tasks/{tid}/claim", data={"csrf": csrf})
    assert (await api.http.post(f"/ui/tasks/{tid}/delegate", data={"csrf": "0" * 40, "to": "kim"})).status_code == 403
    r = await api.http.post(f"/ui/tasks/{tid}/delegate", data={"csrf": csrf, "to": "kim", "reason": "away"})
    assert r.status_code == 303
    task = await api.engine.client.task(tid)
    assert (task.assignee, task.owner, task.delegation) == ("kim", "mia", "PENDING")
    bob = await _sign_in(api, "bob")  # neither assignee, owner nor candidate
    r = await api.http.post(f"/ui/tasks/{tid}/complete", data={"csrf": bob, "decision": "reject"})
    assert r.status_code == 403
    assert "TaskNotPermitted" in r.text
    assert (await api.engine.client.task(tid)).status == "OPEN"


def test_the_form_follows_the_payload_schema() -> None:
    form = {"oneOf": [
        {"properties": {"decision": {"const": "approve"}, "payload": Approval.model_json_schema()}},
        {"properties": {"decision": {"const": "reject"}, "payload": {"type": "null"}}},
    ]}
    approve, reject = decisions_of(form)
    assert [(f.name, f.kind, f.required) for f in approve.fields] == [
        ("comment", "text", True), ("approved_amount", "integer", True)]
    assert (reject.name, reject.fields, reject.takes_payload) == ("reject", (), False)
    assert payload_of(approve, {"f.comment": " fine ", "f.approved_amount": "12"}) == {
        "comment": "fine", "approved_amount": 12}
    assert payload_of(approve, {"f.comment": ""}) == {}  # left out: the model then names what is missing
    assert payload_of(reject, {}) is None


async def test_a_completion_never_applied_is_not_shown_as_completed(api: Api) -> None:
    """A task cancelled while its completion waited for a worker (COMPLETING, then its instance was
    cancelled) keeps the recorded completion: its page said "Completed as approve by mia"."""
    iid, tid = await _expense(api, "ann")
    await api.engine.client.complete_task(tid, "approve", {"comment": "fine", "approved_amount": 75}, actor="mia")
    await _sign_in(api, "mia")
    page = (await api.http.get(f"/ui/tasks/{tid}")).text
    assert "Being completed as <b>approve</b> by" in page and "Completed as" not in page
    await api.engine.client.cancel(iid, "withdrawn")
    page = (await api.http.get(f"/ui/tasks/{tid}")).text
    assert 'id="task-status">cancelled<' in page
    assert "Completed as" not in page and "was not applied" in page


async def test_a_name_with_spaces_around_it_is_refused_not_trimmed(api: Api) -> None:
    """The form's `to` was stripped before the name check: ' kim ' became kim, where the API and the CLI
    refuse a name no token can have. It is shown as an error on the task's page, nothing changed."""
    _, tid = await _expense(api, "cy")
    csrf = await _sign_in(api, "mia")
    await api.http.post(f"/ui/tasks/{tid}/claim", data={"csrf": csrf})
    for action in ("reassign", "delegate"):
        r = await api.http.post(f"/ui/tasks/{tid}/{action}", data={"csrf": csrf, "to": "kim "})
        assert r.status_code == 422, (action, r.status_code)
        assert "has spaces around it" in r.text, r.text[-2000:]
        assert (await api.engine.client.task(tid)).assignee == "mia"
