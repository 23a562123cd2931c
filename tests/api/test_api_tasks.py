"""Human tasks over HTTP: the inbox (mine, my groups'), count, claim, complete with the decision's
payload, reassign, delegate and resolve; and who may not (401, 404 for another scope, 403, 405)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from stepstone.api import Principal, context_on, create_app
from stepstone.api.tokens import list_tokens
from stepstone.testing import Engine, open_engine
from tests.api import workflows
from tests.api.conftest import Api
from tests.crashes import die_alone

V1 = "/api/v1"
MISSING = "00000000-0000-0000-0000-000000000000"


async def _expense(api: Api | Engine, employee: str, *, scope: str = "default", approver: str | None = None) -> str:
    engine = api.engine if isinstance(api, Api) else api
    iid = await engine.client.start("expense", {"employee": employee, "amount": 40, "approver": approver},
                                    scope=scope)
    await engine.run_until_idle()
    return iid


async def _task_of(engine: Engine, iid: str) -> str:
    [task] = await engine.client.instance_tasks(iid)
    return str(task["id"])


async def test_inbox_lists_my_tasks_in_order_with_count_and_keyset_pages(api: Api) -> None:
    mia = await api.token("task_worker", name="mia")
    first = await _expense(api, "ann")
    second = await _expense(api, "ben")
    await _expense(api, "cy", approver="zoe")  # assigned to someone else: not in mia's inbox
    r = await api.http.get(f"{V1}/tasks", headers=mia, params={"limit": 1})
    assert r.status_code == 200
    page = r.json()
    assert [t["instance_id"] for t in page["items"]] == [first]
    assert page["items"][0]["title"] == "Approve ann's expense"
    assert page["items"][0]["data"] == {"employee": "ann", "amount": 40}
    assert page["items"][0]["scope"] == "default"
    assert "approve" in str(page["items"][0]["form"])
    nxt = (await api.http.get(f"{V1}/tasks", headers=mia, params={"limit": 1, "cursor": page["next_cursor"]})).json()
    assert [t["instance_id"] for t in nxt["items"]] == [second]
    assert (await api.http.get(f"{V1}/tasks/count", headers=mia)).json()["count"] == 2
    zoe = await api.token("task_worker", name="zoe")
    assigned = (await api.http.get(f"{V1}/tasks", headers=zoe, params={"mode": "assigned"})).json()["items"]
    assert [t["assignee"] for t in assigned] == ["zoe"]
    found = (await api.http.get(f"{V1}/tasks", headers=mia, params={"text": "BEN"})).json()["items"]
    assert [t["instance_id"] for t in found] == [second]
    r = await api.http.get(f"{V1}/tasks", headers=mia, params={"cursor": "not-a-cursor"})
    assert (r.status_code, r.json()["error"]) == (422, "InvalidInput")


async def test_the_inbox_hides_what_was_put_aside_until_later(api: Api) -> None:
    """The follow-up filters of the inbox (docs/tasks.md) that Python and the CLI take were ignored over
    HTTP: a task put aside until next year was in every page and count."""
    mia = await api.token("task_worker", name="mia")
    now_task = await _expense(api, "ann")
    later = await api.engine.client.start("expense", {"employee": "ben", "amount": 40,
                                                      "call_at": "2100-01-01T09:00:00+00:00"})
    await api.engine.run_until_idle()

    async def listed(**params: Any) -> tuple[list[str], int]:
        items = (await api.http.get(f"{V1}/tasks", headers=mia, params=params)).json()["items"]
        count = (await api.http.get(f"{V1}/tasks/count", headers=mia, params=params)).json()["count"]
        return [t["instance_id"] for t in items], count

    assert await listed() == ([now_task, later], 2)
    assert await listed(hide_later_follow_ups="true") == ([now_task], 1)
    assert await listed(follow_up_before="2099-12-31T00:00:00Z") == ([now_task], 1)
    assert await listed(follow_up_before="2100-01-01T09:00:00Z") == ([now_task, later], 2)
    r = await api.http.get(f"{V1}/tasks", headers=mia, params={"follow_up_before": "soon"})
    assert (r.status_code, r.json()["error"]) == (422, "InvalidInput")


async def test_a_tokens_groups_offer_it_their_tasks(api: Api) -> None:
    """The expense task is offered to the user mia and the group finance: a token of another name sees
    it only when the token is in that group."""
    iid = await _expense(api, "dee")
    outsider = await api.token("task_worker", name="ola")
    assert (await api.http.get(f"{V1}/tasks", headers=outsider)).json()["items"] == []
    member = await api.token("task_worker", name="ola", groups=("finance", "finance"))
    page = (await api.http.get(f"{V1}/tasks", headers=member)).json()["items"]
    assert [t["instance_id"] for t in page] == [iid]
    claimed = await api.http.post(f"{V1}/tasks/{page[0]['id']}/claim", headers=member)
    assert (claimed.status_code, claimed.json()["assignee"]) == (200, "ola")
    [record] = [t for t in await list_tokens(api.ctx.management) if t.groups]
    assert record.groups == ("finance",)  # given twice, kept once


async def test_a_completion_repeated_under_its_key_after_the_task_was_given_back_completes_it(api: Api) -> None:
    """A completion dead-lettered and its instance retried gives the task back; the repeat of the request
    with the same idempotency key answered 202, duplicate, task OPEN, and recorded nothing."""
    mia = await api.token("task_worker", name="mia")
    iid = await _expense(api, "ann")
    tid = await _task_of(api.engine, iid)
    request = {"decision": "approve", "payload": {"comment": "fine", "approved_amount": 40},
               "idempotency_key": "k-1"}
    first = await api.http.post(f"{V1}/tasks/{tid}/complete", headers=mia, json=request)
    assert (first.status_code, first.json()["duplicate"]) == (202, False)
    assert {claim.command.kind for claim in await die_alone(api.engine)} == {"TASK_COMPLETION"}
    await api.engine.run_until_idle()
    await api.engine.client.retry(iid)
    await api.engine.run_until_idle()
    assert (await api.engine.client.task(tid)).status == "OPEN"
    again = await api.http.post(f"{V1}/tasks/{tid}/complete", headers=mia, json=request)
    assert (again.status_code, again.json()["duplicate"], again.json()["task"]["status"]) == (202, False, "COMPLETING")
    assert again.json()["command_id"] != first.json()["command_id"]
    await api.engine.run_until_idle()
    assert (await api.engine.client.get(iid)).state["outcome"] == "paid by mia"


async def test_claim_and_complete_with_the_decisions_payload_moves_the_instance(api: Api) -> None:
    mia = await api.token("task_worker", name="mia")
    iid = await _expense(api, "ann")
    tid = await _task_of(api.engine, iid)
    claimed = (await api.http.post(f"{V1}/tasks/{tid}/claim", headers=mia)).json()
    assert claimed["assignee"] == "mia"
    r = await api.http.post(f"{V1}/tasks/{tid}/complete", headers=mia,
                            json={"decision": "approve", "payload": {"comment": "fine"}})
    assert (r.status_code, r.json()["error"]) == (422, "InvalidInput")
    assert "approved_amount" in r.json()["detail"]
    r = await api.http.post(f"{V1}/tasks/{tid}/complete", headers=mia,
                            json={"decision": "approve", "payload": {"comment": "fine", "approved_amount": 40}})
    assert r.status_code == 202
    assert r.json()["task"]["status"] == "COMPLETING"
    await api.engine.run_until_idle()
    info = await api.engine.client.get(iid)
    assert (info.status, info.state["outcome"], info.state["comment"]) == ("COMPLETED", "paid by mia", "fine")
    again = await api.http.post(f"{V1}/tasks/{tid}/complete", headers=mia, json={"decision": "reject"})
    assert (again.status_code, again.json()["error"]) == (409, "TaskNotOpen")
    # The completion that won, as TaskNotOpen.completion carries it; the status is the task's, named so.
    won = (await api.engine.client.task(tid)).completion
    assert won is not None and again.json()["completion"]["decision"] == "approve"
    assert again.json()["completion"]["actor"] == won["actor"] == "mia"
    assert (again.json()["task_status"], again.json()["task_id"]) == ("COMPLETED", tid)
    assert "instance_status" not in again.json()


async def test_a_non_assignee_completing_is_403_and_an_admin_override_is_recorded(api: Api) -> None:
    iid = await _expense(api, "ann", approver="zoe")
    tid = await _task_of(api.engine, iid)
    bob = await api.token("task_worker", name="bob")
    r = await api.http.post(f"{V1}/tasks/{tid}/complete", headers=bob, json={"decision": "reject"})
    assert (r.status_code, r.json()["error"]) == (403, "TaskNotPermitted")
    assert (r.json()["task_status"], r.json()["actor"], r.json()["completion"]) == ("OPEN", "bob", None)
    assert "instance_status" not in r.json()
    r = await api.http.post(f"{V1}/tasks/{tid}/complete", headers=bob, json={"decision": "reject", "admin": True})
    assert (r.status_code, r.json()["error"], r.json()["role"]) == (403, "Forbidden", "admin")
    assert (await api.engine.client.task(tid)).status == "OPEN"
    boss = await api.token("admin", name="boss")
    r = await api.http.post(f"{V1}/tasks/{tid}/complete", headers=boss, json={"decision": "reject", "admin": True})
    assert r.status_code == 202
    assert r.json()["task"]["completion"]["actor"] == "boss"
    await api.engine.run_until_idle()
    assert (await api.engine.client.get(iid)).state["outcome"] == "declined"


async def test_reassign_delegate_and_resolve(api: Api) -> None:
    zoe = await api.token("task_worker", name="zoe")
    kim = await api.token("task_worker", name="kim")
    tid = await _task_of(api.engine, await _expense(api, "ann", approver="zoe"))
    r = await api.http.post(f"{V1}/tasks/{tid}/delegate", headers=zoe, json={"to": "kim", "reason": "holiday"})
    assert (r.json()["assignee"], r.json()["owner"], r.json()["delegation"]) == ("kim", "zoe", "PENDING")
    r = await api.http.post(f"{V1}/tasks/{tid}/resolve", headers=kim)
    assert (r.json()["assignee"], r.json()["delegation"]) == ("zoe", "RESOLVED")
    r = await api.http.post(f"{V1}/tasks/{tid}/reassign", headers=kim, json={"to": "kim"})
    assert (r.status_code, r.json()["error"]) == (403, "TaskNotPermitted")
    r = await api.http.post(f"{V1}/tasks/{tid}/reassign", headers=zoe, json={"to": "kim"})
    assert r.json()["assignee"] == "kim"
    r = await api.http.post(f"{V1}/tasks/{tid}/unclaim", headers=kim)
    assert r.json()["assignee"] is None
    assert (await api.http.get(f"{V1}/tasks/{tid}", headers=kim)).json()["status"] == "OPEN"


async def test_unclaiming_a_task_nobody_holds_is_for_those_who_may_work_on_it(api: Api) -> None:
    """An unassigned task: unclaiming it changes nothing; a candidate (a user or a group's) gets the task,
    anyone else 403 TaskNotPermitted as for an assigned one (docs/api.md, Human tasks)."""
    tid = await _task_of(api.engine, await _expense(api, "ann"))  # offered to mia and the group finance
    kim = await api.token("task_worker", name="kim")
    r = await api.http.post(f"{V1}/tasks/{tid}/unclaim", headers=kim)
    assert (r.status_code, r.json()["error"], r.json()["actor"]) == (403, "TaskNotPermitted", "kim")
    for name, groups in (("mia", ()), ("lou", ("finance",))):
        r = await api.http.post(f"{V1}/tasks/{tid}/unclaim", headers=await api.token("task_worker", name=name,
                                                                                      groups=groups))
        assert (r.status_code, r.json()["assignee"]) == (200, None), name
    boss = await api.token("admin", name="boss")
    r = await api.http.post(f"{V1}/tasks/{tid}/unclaim", headers=boss, json={"admin": True})
    assert r.status_code == 200, r.text
    assert (await api.engine.client.task(tid)).assignee is None


async def test_task_authorization_401_404_403_and_viewer(api: Api) -> None:
    theirs = await _task_of(api.engine, await _expense(api, "g", scope="globex"))
    mine = await _task_of(api.engine, await _expense(api, "a", scope="acme"))
    acme = await api.token("admin", scope="acme", name="mia")
    listed = (await api.http.get(f"{V1}/tasks", headers=acme)).json()["items"]
    assert [(t["id"], t["scope"]) for t in listed] == [(mine, "acme")]
    # One scope: the inbox query filters by it, so the count is exact (no cap).
    assert (await api.http.get(f"{V1}/tasks/count", headers=acme)).json() == {"count": 1, "more_than_cap": False,
                                                                             "cap": None}
    writes = [("claim", None), ("unclaim", None), ("complete", {"decision": "reject"}), ("reassign", {"to": "x"}),
              ("delegate", {"to": "x"}), ("resolve", None)]
    for action, body in [("", None), *writes]:
        method = "POST" if action else "GET"
        suffix = f"/{action}" if action else ""
        assert (await api.http.request(method, f"{V1}/tasks/{mine}{suffix}", json=body)).status_code == 401
        other = await api.http.request(method, f"{V1}/tasks/{theirs}{suffix}", headers=acme, json=body)
        missing = await api.http.request(method, f"{V1}/tasks/{MISSING}{suffix}", headers=acme, json=body)
        assert other.status_code == missing.status_code == 404, action
        assert other.json()["detail"].replace(theirs, "X") == missing.json()["detail"].replace(MISSING, "X")
    viewer = await api.token("viewer", scope="acme", name="mia")
    assert (await api.http.get(f"{V1}/tasks/{mine}", headers=viewer)).status_code == 200
    for action, body in writes:
        r = await api.http.post(f"{V1}/tasks/{mine}/{action}", headers=viewer, json=body)
        assert (r.status_code, r.json()["role"]) == (403, "task_worker"), action
    assert (await api.engine.client.task(theirs)).status == "OPEN"
    assert (await api.engine.client.task(mine)).assignee is None


async def test_read_only_refuses_task_writes(read_only_api: Api) -> None:
    tid = await _task_of(read_only_api.engine, await _expense(read_only_api, "r"))
    mia = await read_only_api.token("admin", name="mia")
    r = await read_only_api.http.post(f"{V1}/tasks/{tid}/complete", headers=mia, json={"decision": "reject"})
    assert (r.status_code, r.json()["error"]) == (405, "ReadOnly")
    assert (await read_only_api.http.get(f"{V1}/tasks/{tid}", headers=mia)).status_code == 200


GROUPS: dict[str, Any] = {"lee": ("finance",), "max": (), "kim": ()}
GRANTS: dict[str, dict[str, str]] = {"kim": {"acme": "task_worker", "globex": "viewer"}}


async def _host_user(request: Request) -> Principal | None:
    user = request.headers.get("x-user", "")
    if user not in GROUPS:
        return None
    return Principal(f"host:{user}", GRANTS.get(user, {"*": "task_worker"}), groups=GROUPS[user], user=user)


@pytest.fixture
async def host(database_url: str) -> AsyncIterator[tuple[Engine, httpx.AsyncClient]]:
    async with open_engine(database_url, workflows.registry) as engine:
        ctx = context_on(engine.store, registry=workflows.registry, authenticate=_host_user)
        try:
            transport = httpx.ASGITransport(app=create_app(ctx, ui=False))
            async with httpx.AsyncClient(transport=transport, base_url="http://host") as http:
                yield engine, http
        finally:
            await ctx.close()


async def test_my_groups_tasks_come_from_the_hosts_principal(host: tuple[Engine, httpx.AsyncClient]) -> None:
    engine, http = host
    iid = await _expense(engine, "ann")
    lee = (await http.get(f"{V1}/tasks", headers={"x-user": "lee"}, params={"mode": "candidate"})).json()
    assert [t["instance_id"] for t in lee["items"]] == [iid]
    assert (await http.get(f"{V1}/tasks", headers={"x-user": "max"})).json()["items"] == []
    tid = lee["items"][0]["id"]
    r = await http.post(f"{V1}/tasks/{tid}/complete", headers={"x-user": "max"}, json={"decision": "reject"})
    assert r.status_code == 403
    r = await http.post(f"{V1}/tasks/{tid}/complete", headers={"x-user": "lee"}, json={"decision": "reject"})
    assert r.status_code == 202
    assert r.json()["task"]["completion"]["actor"] == "lee"


async def test_a_caller_of_several_scopes_gets_exact_pages_and_counts(host: tuple[Engine, httpx.AsyncClient]) -> None:
    # kim sees acme and globex, not initech: the inbox query keeps those two scopes itself, so every
    # page is full and the count exact, with initech's tasks (older, in the same order) never read.
    engine, http = host
    for n in range(3):
        await _expense(engine, f"i{n}", scope="initech")
    ours = [await _expense(engine, f"{scope}{n}", scope=scope) for n in range(2) for scope in ("acme", "globex")]
    kim, seen, cursor = {"x-user": "kim"}, [], None
    while True:
        page = (await http.get(f"{V1}/tasks", headers=kim, params={"mode": "all", "limit": 1,
                                                                   **({"cursor": cursor} if cursor else {})})).json()
        assert len(page["items"]) == 1 or (not page["items"] and page["next_cursor"] is None), page
        seen += [(t["instance_id"], t["scope"]) for t in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted((iid, "acme" if n % 2 == 0 else "globex") for n, iid in enumerate(ours))
    assert (await http.get(f"{V1}/tasks/count", headers=kim, params={"mode": "all"})).json() == {
        "count": 4, "more_than_cap": False, "cap": None}


async def test_a_reassign_to_the_assignee_or_to_a_name_with_spaces_changes_nothing(api: Api) -> None:
    """Reassigning a task to the user who holds it recorded TASK_REASSIGNED though nothing moved; now it
    answers the task as it is and records nothing. A name with a trailing space is refused (422)."""
    zoe = await api.token("task_worker", name="zoe")
    iid = await _expense(api, "ann", approver="zoe")
    tid = await _task_of(api.engine, iid)
    before = [e.kind for e in (await api.engine.client.history_page(iid, limit=500)).entries]
    for op in ("reassign", "delegate"):
        r = await api.http.post(f"{V1}/tasks/{tid}/{op}", headers=zoe, json={"to": "zoe"})
        assert (r.status_code, r.json()["assignee"], r.json()["delegation"]) == (200, "zoe", None), r.text
    r = await api.http.post(f"{V1}/tasks/{tid}/reassign", headers=zoe, json={"to": "kim "})
    assert (r.status_code, r.json()["error"]) == (422, "InvalidInput"), r.text
    assert [e.kind for e in (await api.engine.client.history_page(iid, limit=500)).entries] == before
    assert (await api.engine.client.task(tid)).assignee == "zoe"
