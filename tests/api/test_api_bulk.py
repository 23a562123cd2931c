"""Bulk retry and cancel over HTTP: a selection or a filter, a dry run with an honest count, a result
per instance, and only where the caller is operator."""

from __future__ import annotations

from stepstone.api.pagination import encode_cursor
from tests.api import workflows
from tests.api.conftest import Api

V1 = "/api/v1"
MISSING = "00000000-0000-0000-0000-000000000000"


async def test_retry_by_filter_dry_run_counts_then_each_instance_gets_its_result(api: Api) -> None:
    one = await api.start("one", fail=True)
    two = await api.start("two", fail=True)
    await api.start("fine")
    operator = await api.token("operator")
    body = {"filter": {"status": ["FAILED"], "workflow": "job"}, "dry_run": True}
    dry = (await api.http.post(f"{V1}/bulk/retry", headers=operator, json=body)).json()
    assert (dry["dry_run"], dry["matched"], dry["succeeded"], dry["items"]) == (True, 2, 0, [])
    assert (await api.engine.client.get(one)).status == "FAILED"
    workflows.FAILING.discard("one")
    done = (await api.http.post(f"{V1}/bulk/retry", headers=operator, json={**body, "dry_run": False})).json()
    assert (done["matched"], done["succeeded"], done["failed"]) == (2, 2, 0)
    assert sorted(i["id"] for i in done["items"]) == sorted([one, two])
    assert {i["outcome"] for i in done["items"]} == {"retried"}
    await api.engine.run_until_idle()
    assert [(await api.engine.client.get(i)).status for i in (one, two)] == ["WAITING", "FAILED"]


async def test_retry_a_selection_reports_the_ones_that_cannot_be_retried(api: Api) -> None:
    failed = await api.start("f", fail=True)
    waiting = await api.start("w")
    operator = await api.token("operator")
    r = await api.http.post(f"{V1}/bulk/retry", headers=operator, json={"ids": [failed, waiting, MISSING]})
    report = r.json()
    by_id = {i["id"]: i for i in report["items"]}
    assert (report["succeeded"], report["failed"]) == (1, 2)
    assert by_id[failed]["ok"] and not by_id[waiting]["ok"]
    assert by_id[waiting]["outcome"] == "not_failed"
    assert "only a FAILED or COMPENSATION_FAILED instance" in by_id[waiting]["reason"]
    assert (by_id[MISSING]["outcome"], by_id[MISSING]["reason"]) == ("not_found", "no such instance")
    r = await api.http.post(f"{V1}/bulk/retry", headers=operator, json={"ids": ["nope"]})
    assert r.status_code == 422
    r = await api.http.post(f"{V1}/bulk/retry", headers=operator, json={"ids": [failed], "filter": {}})
    assert (r.status_code, r.json()["error"]) == (422, "InvalidInput")


async def test_bulk_cancel_by_filter_with_a_reason(api: Api) -> None:
    a = await api.start("a")
    b = await api.start("b")
    operator = await api.token("operator")
    r = await api.http.post(f"{V1}/bulk/cancel", headers=operator,
                            json={"filter": {"status": ["WAITING"]}, "reason": "closing the shop"})
    assert (r.json()["matched"], r.json()["succeeded"]) == (2, 2)
    assert {(await api.engine.client.get(i)).status for i in (a, b)} == {"CANCELLED"}


async def test_a_filter_that_only_widens_is_refused_as_an_empty_one(api: Api) -> None:
    """`include_archived` (and an empty `business_key_contains`) keep every instance: acting on all of them
    must be said with a filter that names them (docs/api.md)."""
    waiting = await api.start("w")
    operator = await api.token("operator")
    for action in ("cancel", "retry", "migrate"):
        for widening in ({"include_archived": True}, {"business_key_contains": ""},
                         {"include_archived": True, "business_key_contains": ""}):
            body = {"filter": widening, "dry_run": True, **({"to_version": 2} if action == "migrate" else {})}
            r = await api.http.post(f"{V1}/bulk/{action}", headers=operator, json={**body, "dry_run": False})
            assert (r.status_code, r.json()["error"]) == (422, "InvalidInput"), (action, widening, r.text)
            assert "would select every instance" in r.json()["detail"]
    assert (await api.engine.client.get(waiting)).status == "WAITING"
    narrowed = {"filter": {"include_archived": True, "status": ["WAITING"]}, "dry_run": True}
    assert (await api.http.post(f"{V1}/bulk/cancel", headers=operator, json=narrowed)).json()["matched"] == 1


async def test_bulk_acts_only_where_the_caller_is_operator(api: Api) -> None:
    mine = await api.start("m", scope="acme", fail=True)
    theirs = await api.start("t", scope="globex", fail=True)
    viewed = await api.start("v", scope="initech", fail=True)
    acme = (await api.token("operator", scope="acme"))["Authorization"]
    everything = {"filter": {"status": ["FAILED"]}, "dry_run": True}
    r = await api.http.post(f"{V1}/bulk/retry", headers={"Authorization": acme}, json=everything)
    assert r.json()["matched"] == 1  # only acme's: globex's and initech's are not counted
    r = await api.http.post(f"{V1}/bulk/retry", headers={"Authorization": acme},
                            json={"filter": {"scope": "globex"}, "dry_run": True})
    assert r.json()["matched"] == 0
    r = await api.http.post(f"{V1}/bulk/retry", headers={"Authorization": acme}, json={"ids": [mine, theirs]})
    by_id = {i["id"]: i for i in r.json()["items"]}
    assert by_id[mine]["ok"] and (by_id[theirs]["outcome"], by_id[theirs]["reason"]) == ("not_found",
                                                                                         "no such instance")
    viewer = await api.token("viewer", scope="initech")
    for path in ("retry", "cancel"):
        r = await api.http.post(f"{V1}/bulk/{path}", headers=viewer, json={"ids": [viewed]})
        assert (r.status_code, r.json()["role"]) == (403, "operator")
        assert (await api.http.post(f"{V1}/bulk/{path}", json={"ids": [viewed]})).status_code == 401
    assert (await api.engine.client.get(theirs)).status == "FAILED"
    assert (await api.engine.client.get(viewed)).status == "FAILED"


async def test_a_nul_character_in_a_bulk_request_is_refused_not_a_server_error(api: Api) -> None:
    """PostgreSQL text cannot hold NUL; the fuzzed API test once sent one in a bulk cancel (a 500)."""
    waiting = await api.start("n")
    operator = await api.token("operator")
    for path, body in (("cancel", {"ids": [waiting], "reason": "a\x00b"}),
                       ("cancel", {"filter": {"workflow": "job\x00"}}),
                       ("retry", {"filter": {"business_key_contains": "\x00"}}),
                       ("migrate", {"ids": [waiting], "to_version": 1, "step_map": {"a\x00": "b"}})):
        r = await api.http.post(f"{V1}/bulk/{path}", headers=operator, json=body)
        assert (path, r.status_code) == (path, 422), r.text
    assert (await api.engine.client.get(waiting)).status == "WAITING"


async def test_an_instant_outside_what_the_driver_holds_is_refused_not_a_server_error(api: Api) -> None:
    """Year 1 at +00:01 is year 0 in UTC, which the driver cannot send; the fuzzed API test once sent it as a
    bulk filter's `since` (a 500 from the driver). Each instant the API takes is checked the same way."""
    waiting = await api.start("n")
    operator = await api.token("operator")
    for field, instant in (("since", "0001-01-01T00:00:00+00:01"), ("until", "9999-12-31T23:59:59-00:01"),
                           ("updated_since", "0001-01-01T00:00:00+23:59"),
                           ("updated_until", "0001-01-01T00:30:00+01:00")):
        r = await api.http.post(f"{V1}/bulk/cancel", headers=operator, json={"filter": {field: instant}})
        assert (field, r.status_code, r.headers["content-type"]) == (field, 422, "application/problem+json"), r.text
    r = await api.http.get(f"{V1}/tasks", headers=operator, params={"due_before": "0001-01-01T00:00:00+00:01"})
    assert r.status_code == 422, r.text
    cursor = encode_cursor("0001-01-01T00:00:00+00:01", waiting)  # a page cursor made up, not one the API gave
    r = await api.http.get(f"{V1}/instances", headers=operator, params={"cursor": cursor})
    assert (r.status_code, r.json()["error"]) == (422, "InvalidInput"), r.text
    r = await api.http.post(f"{V1}/bulk/cancel", headers=operator,
                            json={"dry_run": True, "filter": {"since": "0001-01-01T00:00:00Z"}})
    assert r.status_code == 200, r.text  # the earliest instant there is: accepted
    assert (await api.engine.client.get(waiting)).status == "WAITING"
