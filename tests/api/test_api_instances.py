"""The management API against a real PostgreSQL: reads, writes, pagination, problem+json errors."""

from __future__ import annotations

from typing import get_args

import pytest

from stepstone.api.routes.instances import StatusName
from stepstone.core.model import STATUSES
from stepstone.errors import InvalidInput
from stepstone.ops import Operations
from tests.api import workflows
from tests.api.conftest import Api

V1 = "/api/v1"


async def test_list_get_history_and_positions(api: Api) -> None:
    viewer = await api.token("viewer")
    iid = await api.start("alpha")
    r = await api.http.get(f"{V1}/instances", headers=viewer)
    assert r.status_code == 200
    assert [i["id"] for i in r.json()["items"]] == [iid]
    assert r.json()["next_cursor"] is None

    r = await api.http.get(f"{V1}/instances/{iid}", headers=viewer)
    body = r.json()
    assert (body["status"], body["step"], body["scope"]) == ("WAITING", "approval", "default")
    assert body["waiting_for"]["signals"] == {"approve": "ship", "reject": "refund"}

    history = (await api.http.get(f"{V1}/instances/{iid}/history", headers=viewer)).json()["items"]
    assert [h["kind"] for h in history][:2] == ["INSTANCE_STARTED", "STEP_COMPLETED"]
    positions = (await api.http.get(f"{V1}/instances/{iid}/positions", headers=viewer)).json()
    assert [(p["path"], p["step"], p["status"]) for p in positions] == [("", "approval", "WAITING")]
    assert (await api.http.get(f"{V1}/instances/{iid}/children", headers=viewer)).json() == []
    events = (await api.http.get(f"{V1}/instances/{iid}/outbox", headers=viewer)).json()["items"]
    assert [e["type"] for e in events] == ["job.charged"]
    counts = (await api.http.get(f"{V1}/instances/counts", headers=viewer)).json()
    assert counts == {"counts": {"WAITING": 1}, "more_than": [], "cap": 10_000}


async def test_keyset_pagination_walks_every_instance_once_newest_first(api: Api) -> None:
    viewer = await api.token("viewer")
    ids = [await api.engine.client.start("job", {"name": f"n{n}"}) for n in range(7)]
    await api.engine.run_until_idle()
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        r = await api.http.get(f"{V1}/instances", headers=viewer, params=params)
        assert r.status_code == 200
        seen += [i["id"] for i in r.json()["items"]]
        pages += 1
        cursor = r.json()["next_cursor"]
        if cursor is None:
            break
    assert pages == 3
    assert seen == list(reversed(ids))

    history = (await api.http.get(f"{V1}/instances/{ids[0]}/history", headers=viewer,
                                  params={"limit": 1})).json()
    second = (await api.http.get(f"{V1}/instances/{ids[0]}/history", headers=viewer,
                                 params={"limit": 1, "cursor": history["next_cursor"]})).json()
    assert history["next_cursor"] is not None
    assert [h["seq"] for h in history["items"] + second["items"]] == [1, 2]


async def test_start_signal_and_complete_recorded_as_the_token_actor(api: Api) -> None:
    operator = await api.token("operator", name="ops-bot")
    r = await api.http.post(f"{V1}/instances", headers=operator, json={"workflow": "job", "input": {"name": "b"}})
    assert r.status_code == 201, r.text
    iid = r.json()["id"]
    await api.engine.run_until_idle()
    r = await api.http.post(f"{V1}/instances/{iid}/signals", headers=operator, json={"name": "approve"})
    assert r.status_code == 202, r.text
    await api.engine.run_until_idle()
    info = await api.engine.client.get(iid)
    assert info.status == "COMPLETED"
    assert info.state["log"] == ["charged", "shipped"]
    history = await api.engine.client.history(iid)
    assert history[0]["actor"] == "token:ops-bot"
    commands = (await api.http.get(f"{V1}/instances/{iid}/commands", headers=operator)).json()["items"]
    assert [c["kind"] for c in commands][:1] == ["START"]
    assert any(c["kind"] == "SIGNAL" and c["name"] == "approve" for c in commands)


async def test_failed_instance_is_a_dead_letter_and_retry_completes_it(api: Api) -> None:
    operator = await api.token("operator")
    iid = await api.start("broken", fail=True)
    assert (await api.engine.client.get(iid)).status == "FAILED"
    failed = (await api.http.get(f"{V1}/instances", headers=operator, params={"status": "FAILED"})).json()
    assert [i["id"] for i in failed["items"]] == [iid]
    only_failures = (await api.http.get(f"{V1}/instances/{iid}/history", headers=operator,
                                        params={"failed_only": "true"})).json()["items"]
    assert only_failures and all("FAIL" in h["kind"] or "DEAD" in h["kind"] for h in only_failures)
    # where the handler raised (docs/api.md, "Failures"): in the error and in each failed attempt's entry
    error = (await api.http.get(f"{V1}/instances/{iid}", headers=operator)).json()["error"]
    assert [(f["function"], f["source"]) for f in error["frames"]] == [
        ("charge", 'raise Declined(f"card declined for {state.name}")')]
    assert all(h["data"]["frames"] == error["frames"] for h in only_failures if h["kind"] == "STEP_FAILED")

    workflows.FAILING.discard("broken")
    r = await api.http.post(f"{V1}/instances/{iid}/retry", headers=operator)
    assert r.status_code == 200, r.text
    await api.engine.run_until_idle()
    assert (await api.engine.client.get(iid)).status == "WAITING"

    r = await api.http.post(f"{V1}/instances/{iid}/retry", headers=operator)
    assert r.status_code == 409
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["error"] == "InvalidState"
    assert r.json()["status"] == 409
    assert r.json()["instance_id"] == iid
    assert r.json()["instance_status"] == "WAITING"


async def test_cancel_is_idempotent_and_recorded(api: Api) -> None:
    operator = await api.token("operator", name="canceller")
    iid = await api.start("c")
    for _ in range(2):
        r = await api.http.post(f"{V1}/instances/{iid}/cancel", headers=operator, json={"reason": "test"})
        assert r.status_code == 200
        assert r.json()["status"] == "CANCELLED"
    cancelled = [h for h in await api.engine.client.history(iid) if h["kind"] == "INSTANCE_CANCELLED"]
    assert [h["actor"] for h in cancelled] == ["token:canceller"]


async def test_start_takes_a_deadline_and_cancel_compensates_as_the_cli_and_client_do(api: Api) -> None:
    """`stepstone start --deadline` and `stepstone cancel --compensate` (and the client's `deadline=` and
    `compensate=True`) had no counterpart in the API: both fields were refused as unknown (422)."""
    operator = await api.token("operator")
    r = await api.http.post(f"{V1}/instances", headers=operator,
                            json={"workflow": "job", "input": {"name": "late"}, "deadline": 60})
    assert r.status_code == 201, r.text
    late = r.json()["id"]
    await api.engine.run_until_idle()
    assert (await api.engine.client.get(late)).status == "WAITING"
    await api.engine.advance(seconds=61)
    assert (await api.engine.client.get(late)).status == "TIMED_OUT"

    iid = await api.start("undo")
    r = await api.http.post(f"{V1}/instances/{iid}/cancel", headers=operator,
                            json={"reason": "called off", "compensate": True})
    assert r.status_code == 200, r.text
    assert r.json() == {"instance_id": iid, "status": "CANCELLED", "outcome": "compensating"}
    asked = [h["data"] for h in await api.engine.client.history(iid) if h["kind"] == "CANCEL_REQUESTED"]
    assert asked == [{"reason": "called off", "compensate": True, "status_before": "WAITING"}]
    r = await api.http.post(f"{V1}/instances/{iid}/cancel", headers=operator, json={"compensate": True})
    assert r.json() == {"instance_id": iid, "status": "CANCELLED", "outcome": "unchanged"}


async def test_errors_are_problem_json(api: Api) -> None:
    viewer = await api.token("admin")
    cases = [
        ("GET", f"{V1}/instances/00000000-0000-0000-0000-000000000000", None, 404, "InstanceNotFound"),
        ("GET", f"{V1}/instances/not-a-uuid", None, 404, "InstanceNotFound"),
        ("GET", f"{V1}/instances", {"cursor": "garbage"}, 422, "InvalidInput"),
        ("GET", f"{V1}/instances", {"limit": 0}, 422, "InvalidInput"),
        ("GET", f"{V1}/nowhere", None, 404, "NotFound"),
    ]
    for method, url, params, status, error in cases:
        r = await api.http.request(method, url, headers=viewer, params=params)
        assert (r.status_code, r.json()["error"]) == (status, error), (url, r.text)
        assert r.headers["content-type"] == "application/problem+json"
    iid = await api.start("s")
    r = await api.http.post(f"{V1}/instances/{iid}/signals", headers=viewer, json={"name": "no-such"})
    assert (r.status_code, r.json()["error"]) == (422, "UnknownSignal")
    r = await api.http.post(f"{V1}/instances", headers=viewer, json={"workflow": "nope"})
    assert (r.status_code, r.json()["error"]) == (404, "DefinitionNotFound")
    r = await api.http.post(f"{V1}/instances", headers=viewer, json={"workflow": "job", "input": {"name": 5}})
    assert r.status_code == 422
    # Exactly these members: the error's fields that only a batch's refusal sets (item, item_detail) are not
    # in a single start's problem.
    assert set(r.json()) == {"type", "title", "status", "detail", "error", "what"}, r.text
    # A body nested past what the parser takes is a bad request, with a readable type (was h-t-t-p-error).
    deep = b"[" * 100_000 + b"]" * 100_000
    r = await api.http.post(f"{V1}/instances", headers={**viewer, "content-type": "application/json"}, content=deep)
    assert (r.status_code, r.json()["error"]) == (400, "BadRequest")
    assert r.json()["type"] == "urn:stepstone:problem:bad-request"


async def test_a_body_that_is_not_utf8_is_invalid_input_as_any_body_that_is_not_json(api: Api) -> None:
    """docs/api.md keeps 400 for a body nested too deeply; one that is not JSON is 422, and bytes that are
    not UTF-8 are not JSON (it was 400 BadRequest, "There was an error parsing the body")."""
    operator = await api.token("operator")
    for body in (b'{"workflow": "job\xff"}', b'{"name": "\xc3"}', b'\xff{}'):
        r = await api.http.post(f"{V1}/bulk/cancel", headers={**operator, "content-type": "application/json"},
                                content=body)
        assert (r.status_code, r.json()["error"], r.json().get("what")) == (422, "InvalidInput", "body"), r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert "UTF-8" in r.json()["detail"]
    openapi = (await api.http.get(f"{V1}/openapi.json")).json()
    for path, operations in openapi["paths"].items():
        for method, operation in operations.items():
            answers = set(operation["responses"])
            assert {"422", "500", "503"} <= answers, (method, path)
            if "requestBody" in operation:
                assert {"400", "413"} <= answers, (method, path)


async def test_definitions_and_dead_letters(api: Api) -> None:
    viewer = await api.token("viewer")
    iid = await api.start("dead", fail=True)
    defs = (await api.http.get(f"{V1}/definitions", headers=viewer)).json()["items"]
    assert [(d["scope"], d["definition_id"], d["version"]) for d in defs] == [
        ("default", "expense", 1), ("default", "job", 1), ("default", "order", 1), ("default", "order", 2),
        ("default", "trip", 1)]
    plan = (await api.http.get(f"{V1}/definitions/default/job/1", headers=viewer)).json()
    assert [s["name"] for s in plan["plan"]["steps"]] == ["charge", "approval", "ship", "refund"]
    letters = (await api.http.get(f"{V1}/dead-letters", headers=viewer)).json()["items"]
    assert [(d["instance_id"], d["step"]) for d in letters] in ([], [(iid, "charge")])


def test_the_status_filter_takes_every_status() -> None:
    """The API's `status` parameter is a Literal (for the OpenAPI document): the same statuses as
    core.model.STATUSES, which the CLI and the UI offer."""
    assert set(get_args(StatusName)) == set(STATUSES)


async def test_a_status_filter_is_taken_in_any_case_as_the_cli_takes_it(api: Api) -> None:
    viewer = await api.token("viewer")
    iid = await api.start("alpha")
    for status in ("WAITING", "waiting", "Waiting"):  # lower case was a 422
        r = await api.http.get(f"{V1}/instances", headers=viewer, params={"status": status})
        assert [i["id"] for i in r.json()["items"]] == [iid], r.text
    r = await api.http.get(f"{V1}/instances", headers=viewer, params={"status": "sleeping"})
    assert (r.status_code, r.json()["error"]) == (422, "InvalidInput")


async def test_archived_instances_are_left_out_of_the_list_and_counts_unless_asked(api: Api) -> None:
    """As `stepstone find` and `Client.find`: an instance past its retention window is hidden from the
    list and the counts (API and UI) unless `include_archived`, and one that changes again shows."""
    admin = await api.token("admin")
    policy = {"workflow": "job", "status_class": "completed", "retain_for_seconds": 3600,
              "purge_after_seconds": 86400}
    assert (await api.http.put(f"{V1}/retention/policies", headers=admin, json=policy)).status_code == 200
    old = await api.engine.client.start("job", {"name": "old"})
    await api.engine.run_until_idle()
    await api.engine.client.signal(old, "approve")
    await api.engine.run_until_idle()
    await api.engine.move_clock(7200)
    for empty in ({"json": {}}, {"json": {"workflow": "job"}}, {}):  # each swept for real: a sweep deletes
        r = await api.http.post(f"{V1}/retention/run", headers=admin, **empty)  # type: ignore[arg-type]
        assert (r.status_code, r.json()["error"]) == (422, "InvalidInput"), (empty, r.text)
    assert (await api.engine.client.get(old)).archived_at is None
    swept = (await api.http.post(f"{V1}/retention/run", headers=admin,
                                 json={"workflow": "job", "dry_run": False})).json()
    assert swept["archived"] == 1
    new = await api.engine.client.start("job", {"name": "new"})
    await api.engine.run_until_idle()

    async def listed(**params: str) -> dict[str, str | None]:
        items = (await api.http.get(f"{V1}/instances", headers=admin, params=params)).json()["items"]
        return {i["id"]: i["archived_at"] for i in items}

    async def counted(**params: str) -> dict[str, int]:
        return dict((await api.http.get(f"{V1}/instances/counts", headers=admin, params=params)).json()["counts"])

    assert await listed() == {new: None}
    assert await listed(status="COMPLETED") == {}
    assert await counted() == {"WAITING": 1}
    everything = await listed(include_archived="true")
    assert set(everything) == {old, new} and everything[old] is not None and everything[new] is None
    assert await counted(include_archived="true") == {"WAITING": 1, "COMPLETED": 1}
    await api.sign_in("viewer")
    ui = (await api.http.get("/ui/")).text
    assert (new in ui, old in ui) == (True, False)
    ui = (await api.http.get("/ui/", params={"archived": "1"})).text
    assert (new in ui, old in ui) == (True, True)


async def test_history_entries_carry_the_actor_and_position_the_cli_shows(api: Api) -> None:
    """The actor is an object (kind, id, reason, on_behalf_of) for every entry, a worker's too, never the
    stored JSON text; the root position is '' (as `stepstone history -o json` gives both)."""
    operator = await api.token("operator", name="ops-bot")
    r = await api.http.post(f"{V1}/instances", headers=operator, json={"workflow": "job", "input": {"name": "h"}})
    iid = r.json()["id"]
    await api.engine.run_until_idle()
    items = (await api.http.get(f"{V1}/instances/{iid}/history", headers=operator)).json()["items"]
    cli = (await Operations.on(api.engine.store).history(iid)).entries
    assert [(h["seq"], h["actor"], h["position"]) for h in items] == [
        (e.seq, e.actor and e.actor.as_dict(), e.position) for e in cli]
    assert items[0]["kind"] == "INSTANCE_STARTED" and items[0]["position"] == ""
    assert items[0]["actor"] == {"kind": "user", "id": "token:ops-bot", "reason": None, "on_behalf_of": None}
    workers = [h["actor"] for h in items if isinstance(h["actor"], dict) and h["actor"]["kind"] == "worker"]
    assert workers, items


async def test_an_instance_is_never_started_in_the_wildcard_scope_or_a_scope_that_is_no_name(api: Api) -> None:
    """`*` is what a grant uses for every scope: no instance may live there (nor in a scope that is no
    name, as a document's scope must be one). The client's check, which the CLI and the API start through."""
    operator = await api.token("operator")
    for scope in ("*", "acme*", " acme", "a/b", "", "9lives"):
        r = await api.http.post("/api/v1/instances", headers=operator,
                                json={"workflow": "job", "input": {"name": "x"}, "scope": scope})
        assert (r.status_code, r.json()["error"], r.json().get("what")) == (422, "InvalidInput", "scope"), scope
        r = await api.http.post("/api/v1/start-or-signal", headers=operator, json={
            "workflow": "job", "business_key": "k", "signal": "approve", "input": {"name": "x"}, "scope": scope})
        assert (r.status_code, r.json()["error"]) == (422, "InvalidInput"), scope
        with pytest.raises(InvalidInput, match="scope"):
            await api.engine.client.start("job", {"name": "x"}, scope=scope)
        with pytest.raises(InvalidInput, match="scope"):
            await api.engine.client.start_many("job", [{"name": "x"}], scope=scope)
    assert (await api.http.get("/api/v1/instances", headers=operator)).json()["items"] == []
    r = await api.http.post("/api/v1/instances", headers=operator,
                            json={"workflow": "job", "input": {"name": "x"}, "scope": "tenant-a.eu_1"})
    assert r.status_code == 201, r.text


async def test_a_sagas_compensations_are_listed(api: Api) -> None:
    """GET /instances/{id}/compensations: there was no HTTP way to see what a saga had to undo and what
    became of each (its step, status and attempts; not what the step recorded, its undo's own input)."""
    workflows.FAILING.add("t-9")
    iid = await api.engine.client.start("trip", {"trip": "t-9"})
    await api.engine.run_until_idle()
    viewer = await api.token("viewer")
    r = await api.http.get(f"{V1}/instances/{iid}/compensations", headers=viewer)
    assert r.status_code == 200, r.text
    [book] = r.json()
    assert (book["step"], book["status"], book["attempts"], book["position"]) == ("book", "COMPENSATED", 1, "")
    assert book["compensated_at"] is not None and "recorded" not in book
    assert (await api.http.get(f"{V1}/instances/{iid}/compensations")).status_code == 401
    other = await api.token("viewer", scope="acme")
    assert (await api.http.get(f"{V1}/instances/{iid}/compensations", headers=other)).status_code == 404
