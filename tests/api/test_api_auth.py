"""Authorization: no token 401, another scope 404 (never a leak), a missing role 403, read-only 405."""

from __future__ import annotations

import re

import asyncpg

from stepstone.api.tokens import revoke_token
from tests.api.conftest import Api

V1 = "/api/v1"
MISSING = "00000000-0000-0000-0000-000000000000"


async def test_no_token_bad_token_and_revoked_token_are_401(api: Api) -> None:
    iid = await api.start("a")
    for headers in ({}, {"Authorization": "Bearer sst_wrong"}, {"Authorization": "Basic eDp5"}):
        r = await api.http.get(f"{V1}/instances/{iid}", headers=headers)
        assert r.status_code == 401
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"] == "Unauthenticated"
    headers = await api.token("viewer")
    assert (await api.http.get(f"{V1}/instances/{iid}", headers=headers)).status_code == 200
    [record] = list(await api.ctx.management.list_tokens(include_revoked=False))
    await revoke_token(api.ctx.management, record.id)
    assert (await api.http.get(f"{V1}/instances/{iid}", headers=headers)).status_code == 401


async def test_the_api_ignores_the_ui_cookie(api: Api) -> None:
    headers = await api.token("admin")
    token = headers["Authorization"].removeprefix("Bearer ")
    api.http.cookies.set("stepstone_token", token)
    try:
        assert (await api.http.get(f"{V1}/instances")).status_code == 401
    finally:
        api.http.cookies.clear()


async def test_another_scope_is_not_found_exactly_like_a_missing_instance(api: Api) -> None:
    theirs = await api.start("theirs", scope="globex")
    mine = await api.start("mine", scope="acme")
    acme = await api.token("admin", scope="acme")
    listed = (await api.http.get(f"{V1}/instances", headers=acme)).json()["items"]
    assert [i["id"] for i in listed] == [mine]
    assert (await api.http.get(f"{V1}/instances", headers=acme, params={"scope": "globex"})).json()["items"] == []
    assert (await api.http.get(f"{V1}/instances/counts", headers=acme)).json()["counts"] == {"WAITING": 1}
    for suffix, method, body in [
        ("", "GET", None), ("/history", "GET", None), ("/commands", "GET", None), ("/positions", "GET", None),
        ("/outbox", "GET", None), ("/signals", "POST", {"name": "approve"}), ("/cancel", "POST", {}),
        ("/retry", "POST", None),
    ]:
        other = await api.http.request(method, f"{V1}/instances/{theirs}{suffix}", headers=acme, json=body)
        missing = await api.http.request(method, f"{V1}/instances/{MISSING}{suffix}", headers=acme, json=body)
        assert other.status_code == missing.status_code == 404, suffix
        assert other.json()["detail"].replace(theirs, "X") == missing.json()["detail"].replace(MISSING, "X")
    assert (await api.engine.client.get(theirs)).status == "WAITING"
    r = await api.http.get(f"{V1}/definitions/globex/job/1", headers=acme)
    assert r.status_code == 404
    r = await api.http.post(f"{V1}/instances", headers=acme, json={"workflow": "job", "input": {"name": "x"},
                                                                    "scope": "globex"})
    assert r.status_code == 404
    r = await api.http.post(f"{V1}/instances", headers=acme, json={"workflow": "job", "input": {"name": "x"}})
    assert (r.status_code, r.json()["scope"]) == (201, "acme")


async def test_a_token_without_the_role_is_refused_with_403(api: Api) -> None:
    iid = await api.start("v", scope="acme")
    for role in ("viewer", "task_worker"):
        headers = await api.token(role, scope="acme")
        assert (await api.http.get(f"{V1}/instances/{iid}", headers=headers)).status_code == 200
        for suffix, body in [("/signals", {"name": "approve"}), ("/cancel", {}), ("/retry", None)]:
            r = await api.http.post(f"{V1}/instances/{iid}{suffix}", headers=headers, json=body)
            assert r.status_code == 403, (role, suffix)
            assert r.json()["error"] == "Forbidden"
            assert (r.json()["role"], r.json()["scope"]) == ("operator", "acme")
        r = await api.http.post(f"{V1}/instances", headers=headers, json={"workflow": "job", "input": {"name": "n"}})
        assert r.status_code == 403
    assert (await api.engine.client.get(iid)).status == "WAITING"
    scoped_operator = await api.token("operator", scope="acme")
    assert (await api.http.get(f"{V1}/outbox/status", headers=scoped_operator)).status_code == 403
    r = await api.http.post(f"{V1}/outbox/requeue", headers=scoped_operator, json={"all_dead": True})
    assert r.status_code == 403


def _writes(api: Api) -> list[tuple[str, str]]:
    """Every state-changing operation the OpenAPI schema lists (a new router's are included)."""
    found = []
    for path, operations in api.app.openapi()["paths"].items():
        concrete = re.sub(r"\{[^}]+\}", MISSING, path)
        found += [(m.upper(), concrete) for m in operations if m.upper() not in {"GET", "HEAD", "OPTIONS"}]
    return found


async def test_read_only_refuses_every_write_with_405(read_only_api: Api) -> None:
    api = read_only_api
    iid = await api.start("ro")
    admin = await api.token("admin")
    writes = _writes(api)
    assert len(writes) >= 5
    for method, path in writes:
        for headers in (admin, {}):
            r = await api.http.request(method, path.replace(MISSING, iid), headers=headers, json={})
            assert r.status_code == 405, (method, path)
            assert r.headers["content-type"] == "application/problem+json"
            assert r.json()["error"] == "ReadOnly"
            # before its body is read: a malformed one was parsed first and answered 422
            r = await api.http.request(method, path.replace(MISSING, iid), headers={
                **headers, "content-type": "application/json"}, content=b"{not json")
            assert (r.status_code, r.json()["error"]) == (405, "ReadOnly"), (method, path, r.text)
    assert (await api.http.get(f"{V1}/instances/{iid}", headers=admin)).status_code == 200
    assert (await api.http.get(f"{V1}/whoami", headers=admin)).json()["read_only"] is True
    assert (await api.engine.client.get(iid)).status == "WAITING"


async def test_outbox_status_events_and_requeue_with_a_dry_run(api: Api, database_url: str) -> None:
    operator = await api.token("operator")
    await api.start("o1")
    await api.start("o2")
    conn = await asyncpg.connect(database_url)
    try:
        dead = await conn.fetchval("UPDATE stepstone.outbox SET dead_at = now(), attempts = 10 "
                                   "WHERE id = (SELECT min(id) FROM stepstone.outbox) RETURNING id")
    finally:
        await conn.close()
    status = (await api.http.get(f"{V1}/outbox/status", headers=operator)).json()
    assert (status["pending"], status["dead"], status["discarded"]) == (1, 1, 0)  # the CLI's fields, discarded too
    events = (await api.http.get(f"{V1}/outbox/events", headers=operator, params={"dead": "true"})).json()
    assert [e["id"] for e in events["items"]] == [dead]
    r = await api.http.post(f"{V1}/outbox/requeue", headers=operator, json={"ids": [dead, 999], "dry_run": True})
    assert r.json() == {"dry_run": True, "matched": 1, "results": [
        {"id": dead, "result": "would_requeue"}, {"id": 999, "result": "not_dead"}]}
    assert (await api.http.get(f"{V1}/outbox/status", headers=operator)).json()["dead"] == 1
    for dry_run in (True, False):  # both selections: refused, as a bulk action refuses ids and a filter
        r = await api.http.post(f"{V1}/outbox/requeue", headers=operator,
                                json={"ids": [dead], "all_dead": True, "dry_run": dry_run})
        assert (r.status_code, r.json()["error"]) == (422, "InvalidInput"), r.text
        assert "not both" in r.json()["detail"]
    assert (await api.http.get(f"{V1}/outbox/status", headers=operator)).json()["dead"] == 1
    r = await api.http.post(f"{V1}/outbox/requeue", headers=operator, json={"ids": [dead, 999]})
    assert r.json()["results"] == [{"id": dead, "result": "requeued"}, {"id": 999, "result": "not_dead"}]
    assert (await api.http.get(f"{V1}/outbox/status", headers=operator)).json()["dead"] == 0


async def test_openapi_schema_lists_the_operations(api: Api) -> None:
    schema = (await api.http.get(f"{V1}/openapi.json")).json()
    paths = schema["paths"]
    for path in (f"{V1}/instances", f"{V1}/instances/{{instance_id}}", f"{V1}/instances/{{instance_id}}/retry",
                 f"{V1}/outbox/requeue", f"{V1}/dead-letters", f"{V1}/definitions"):
        assert path in paths
    assert "application/problem+json" in paths[f"{V1}/instances/{{instance_id}}"]["get"]["responses"]["404"]["content"]


async def test_openapi_declares_the_bearer_scheme_on_every_operation_that_needs_a_token(api: Api) -> None:
    """So /api/v1/docs can send the token ("Authorize"): the scheme, and each operation's security."""
    schema = (await api.http.get(f"{V1}/openapi.json")).json()
    assert schema["components"]["securitySchemes"]["bearer"] | {"description": ""} == {
        "type": "http", "scheme": "bearer", "description": ""}
    secured = {(m, p): o.get("security") for p, ops in schema["paths"].items() for m, o in ops.items()}
    assert secured.pop(("get", f"{V1}/health")) is None
    assert len(secured) >= 30
    assert {str(v) for v in secured.values()} == {str([{"bearer": []}])}


async def test_every_operation_but_health_needs_a_token(api: Api) -> None:
    """Walks the OpenAPI schema, so a new router's endpoints are covered as they land."""
    open_paths = {f"{V1}/health"}
    checked = 0
    for path, operations in api.app.openapi()["paths"].items():
        if path in open_paths:
            continue
        concrete = re.sub(r"\{[^}]+\}", MISSING, path)
        for method in operations:
            r = await api.http.request(method.upper(), concrete, json={})
            assert r.status_code == 401, (method, path, r.status_code)
            checked += 1
    assert checked >= 30
