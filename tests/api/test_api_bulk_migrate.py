"""Bulk migrate over HTTP: a selection or a filter, a dry run that checks each instance and changes
nothing, a result per instance (migrated, would migrate, refused and why, skipped), and only where the
caller is operator; and retention policies set over HTTP with typed refusals."""

from __future__ import annotations

import pytest

from stepstone.api import bulk_migration
from tests.api import workflows
from tests.api.conftest import Api

V1 = "/api/v1"
MISSING = "00000000-0000-0000-0000-000000000000"


async def _order(api: Api, order_id: str, scope: str = "default") -> str:
    iid = await api.engine.client.start(workflows.order, {"order_id": order_id}, scope=scope)
    await api.engine.run_until_idle()
    return iid


async def _version(api: Api, iid: str) -> int:
    return (await api.engine.client.get(iid)).version


async def test_migrate_by_filter_dry_run_checks_each_and_changes_nothing_then_migrates(api: Api) -> None:
    a = await _order(api, "a")
    b = await _order(api, "b")
    job = await api.start("j")
    operator = await api.token("operator")
    body = {"filter": {"workflow": "order", "version": 1}, "to_version": 2, "dry_run": True}
    dry = (await api.http.post(f"{V1}/bulk/migrate", headers=operator, json=body)).json()
    assert (dry["action"], dry["dry_run"], dry["matched"], dry["succeeded"], dry["failed"]) == (
        "migrate", True, 2, 2, 0)
    assert dry["counts"] == {"would migrate": 2} and dry["to_version"] == 2
    assert [i["id"] for i in dry["items"]] == [b, a]  # newest first
    assert [await _version(api, i) for i in (a, b)] == [1, 1]
    done = (await api.http.post(f"{V1}/bulk/migrate", headers=operator, json={**body, "dry_run": False})).json()
    assert (done["matched"], done["succeeded"], done["counts"]) == (2, 2, {"migrated": 2})
    assert all(i["ok"] for i in done["items"])
    assert [await _version(api, i) for i in (a, b, job)] == [2, 2, 1]
    await api.engine.client.signal(a, "nudge")
    await api.engine.run_until_idle()
    assert (await api.engine.client.get(a)).state["got"] == "filed by v2"
    history = await api.engine.client.history(a)
    assert any(h["kind"] == "INSTANCE_MIGRATED" and str(h["actor"]).startswith("token:") for h in history)
    again = (await api.http.post(f"{V1}/bulk/migrate", headers=operator, json=body)).json()
    assert again["matched"] == 0  # on v2 now: version 1 matches none


async def test_migrate_a_selection_answers_each_instance(api: Api) -> None:
    fine = await _order(api, "fine")
    moved = await _order(api, "moved")
    job = await api.start("j")
    operator = await api.token("operator")
    await api.http.post(f"{V1}/bulk/migrate", headers=operator, json={"ids": [moved], "to_version": 2})
    r = await api.http.post(f"{V1}/bulk/migrate", headers=operator,
                            json={"ids": [fine, moved, job, MISSING, fine], "to_version": 2})
    report = r.json()
    by_id = {i["id"]: i for i in report["items"]}
    assert (r.status_code, report["matched"], report["succeeded"], report["failed"], report["skipped"]) == (
        200, 4, 1, 2, 1)
    assert (by_id[fine]["outcome"], by_id[fine]["ok"]) == ("migrated", True)
    assert (by_id[moved]["outcome"], by_id[moved]["reason"]) == ("skipped", "already on v2")
    assert (by_id[job]["outcome"], by_id[job]["ok"]) == ("refused", False)
    assert by_id[job]["reason"] == "this server's workflows have no job v2"
    assert (by_id[MISSING]["outcome"], by_id[MISSING]["reason"]) == ("not_found", "no such instance")
    assert [await _version(api, i) for i in (fine, job)] == [2, 1]


async def test_a_refused_instance_is_reported_with_why_and_left_as_it_was(api: Api) -> None:
    a = await _order(api, "a")
    operator = await api.token("operator")
    r = await api.http.post(f"{V1}/bulk/migrate", headers=operator, json={
        "ids": [a], "to_version": 2, "step_map": {"await_receipt": "nowhere"}})
    [item] = r.json()["items"]
    assert (item["outcome"], item["ok"]) == ("refused", False)
    assert "maps to 'nowhere' through step_map, but v2 has no such step" in item["reason"]
    assert await _version(api, a) == 1


async def test_bulk_migrate_acts_only_where_the_caller_is_operator(api: Api) -> None:
    mine = await _order(api, "m", scope="acme")
    theirs = await _order(api, "t", scope="globex")
    viewed = await _order(api, "v", scope="initech")
    acme = await api.token("operator", scope="acme")
    dry = (await api.http.post(f"{V1}/bulk/migrate", headers=acme, json={
        "filter": {"workflow": "order"}, "to_version": 2, "dry_run": True})).json()
    assert [i["id"] for i in dry["items"]] == [mine]  # globex's and initech's are neither counted nor named
    r = await api.http.post(f"{V1}/bulk/migrate", headers=acme, json={
        "filter": {"scope": "globex"}, "to_version": 2})
    assert (r.json()["matched"], r.json()["items"]) == (0, [])
    r = await api.http.post(f"{V1}/bulk/migrate", headers=acme, json={"ids": [theirs, MISSING], "to_version": 2})
    items = {i["id"]: {k: v for k, v in i.items() if k != "id"} for i in r.json()["items"]}
    assert items[theirs] == items[MISSING]  # another scope's instance looks exactly like a missing one
    viewer = await api.token("viewer", scope="initech")
    r = await api.http.post(f"{V1}/bulk/migrate", headers=viewer, json={"ids": [viewed], "to_version": 2})
    assert (r.status_code, r.json()["role"]) == (403, "operator")
    r = await api.http.post(f"{V1}/bulk/migrate", json={"ids": [viewed], "to_version": 2})
    assert r.status_code == 401
    assert [await _version(api, i) for i in (theirs, viewed)] == [1, 1]


async def test_bulk_migrate_refuses_bad_input_and_a_filter_too_wide(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    await _order(api, "a")
    await _order(api, "b")
    operator = await api.token("operator")
    for body in ({"ids": [MISSING]}, {"ids": [MISSING], "to_version": 0}, {"to_version": 2},
                 {"ids": [MISSING], "filter": {}, "to_version": 2},
                 {"ids": [MISSING], "to_version": 2, "patience_seconds": -1}):
        r = await api.http.post(f"{V1}/bulk/migrate", headers=operator, json=body)
        assert r.status_code == 422, body
    monkeypatch.setattr(bulk_migration, "MAX_MATCHED", 1)
    r = await api.http.post(f"{V1}/bulk/migrate", headers=operator,
                            json={"filter": {"workflow": "order"}, "to_version": 2})
    assert (r.status_code, r.json()["error"]) == (422, "InvalidInput")
    assert "matches more than 1 instances" in r.json()["detail"]


async def test_a_read_only_server_refuses_bulk_migrate_and_setting_a_policy(read_only_api: Api) -> None:
    admin = await read_only_api.token("admin")
    r = await read_only_api.http.post(f"{V1}/bulk/migrate", headers=admin, json={"filter": {"workflow": "job"},
                                                                                 "to_version": 2, "dry_run": True})
    assert r.status_code == 405
    r = await read_only_api.http.put(f"{V1}/retention/policies", headers=admin, json={
        "workflow": "job", "status_class": "completed", "retain_for_seconds": 60})
    assert r.status_code == 405
    assert (await read_only_api.http.get(f"{V1}/retention/policies", headers=admin)).status_code == 200


async def test_setting_a_retention_policy_refuses_a_bad_class_or_window(api: Api) -> None:
    admin = await api.token("admin")
    good = {"workflow": "job", "status_class": "failed", "retain_for_seconds": 7200, "purge_after_seconds": None}
    for bad in ({"status_class": "archived"}, {"retain_for_seconds": -1}, {"purge_after_seconds": 1e12},
                {"retain_for_seconds": "soon"}, {"status_class": "outbox_published"}):
        r = await api.http.put(f"{V1}/retention/policies", headers=admin, json={**good, **bad})
        assert r.status_code == 422, bad
    r = await api.http.put(f"{V1}/retention/policies", headers=admin, json={**good, "status_class": "outbox_published"})
    assert (r.json()["error"], r.json()["detail"]) == (
        "InvalidInput", ("outbox_published takes only the '*' workflow: published outbox rows are dropped for "
                        "every workflow at once"))
    set_ = await api.http.put(f"{V1}/retention/policies", headers=admin, json={**good, "purge_after_seconds": 600})
    assert (set_.status_code, set_.json()["purge_after"]) == (200, "PT10M")
    kept = await api.http.put(f"{V1}/retention/policies", headers=admin, json=good)  # null purge: left as it was
    assert kept.status_code == 200
    listed = (await api.http.get(f"{V1}/retention/policies", headers=admin)).json()
    [row] = [p for p in listed if (p["workflow"], p["status_class"]) == ("job", "failed")]
    assert (row["retain_for"], row["purge_after"]) == ("PT2H", "PT10M")
