"""The operator's tools over HTTP: replay from a step, migrate to another version, retention policies
and sweeps with a dry run, the probe, the stuck report and the stranded-version report; and who may."""

from __future__ import annotations

import re

import pytest

from stepstone.ops import queries
from tests.api import workflows
from tests.api.conftest import Api

V1 = "/api/v1"
MISSING = "00000000-0000-0000-0000-000000000000"


async def test_replay_runs_a_step_again_on_the_state_it_had(api: Api) -> None:
    iid = await api.start("again", fail=True)
    operator = await api.token("operator")
    r = await api.http.post(f"{V1}/instances/{iid}/replay", headers=operator, json={"step": "nowhere"})
    assert (r.status_code, r.json()["error"]) == (422, "InvalidInput")
    workflows.FAILING.clear()
    r = await api.http.post(f"{V1}/instances/{iid}/replay", headers=operator, json={"step": "charge"})
    assert r.status_code == 200
    assert (r.json()["from_step"], r.json()["state"]["name"]) == ("charge", "again")
    await api.engine.run_until_idle()
    assert (await api.engine.client.get(iid)).status == "WAITING"
    history = await api.engine.client.history(iid)
    assert any(h["actor"] == "token:token" or h["actor"].startswith("token:") for h in history
               if "REPLAY" in h["kind"])


async def test_migrate_checks_with_a_dry_run_then_moves_the_instance(api: Api) -> None:
    iid = await api.engine.client.start(workflows.order, {"order_id": "m-1"})
    await api.engine.run_until_idle()
    operator = await api.token("operator")
    dry = await api.http.post(f"{V1}/instances/{iid}/migrate", headers=operator, json={"to_version": 2,
                                                                                      "dry_run": True})
    assert (dry.json()["outcome"], dry.json()["dry_run"]) == ("would migrate", True)
    assert (await api.engine.client.get(iid)).version == 1
    r = await api.http.post(f"{V1}/instances/{iid}/migrate", headers=operator, json={"to_version": 2})
    assert r.json()["outcome"] == "migrated"
    await api.engine.client.signal(iid, "nudge")
    await api.engine.run_until_idle()
    info = await api.engine.client.get(iid)
    assert (info.version, info.state["got"]) == (2, "filed by v2")
    r = await api.http.post(f"{V1}/instances/{iid}/migrate", headers=operator, json={"to_version": 9})
    assert (r.status_code, r.json()["error"]) == (404, "DefinitionNotFound")


async def test_instance_actions_authorization(api: Api) -> None:
    theirs = await api.start("t", scope="globex", fail=True)
    acme = await api.token("admin", scope="acme")
    for action, body in (("replay", {"step": "charge"}), ("migrate", {"to_version": 1})):
        assert (await api.http.post(f"{V1}/instances/{theirs}/{action}", json=body)).status_code == 401
        other = await api.http.post(f"{V1}/instances/{theirs}/{action}", headers=acme, json=body)
        missing = await api.http.post(f"{V1}/instances/{MISSING}/{action}", headers=acme, json=body)
        assert other.status_code == missing.status_code == 404
        viewer = await api.token("viewer", scope="globex")
        r = await api.http.post(f"{V1}/instances/{theirs}/{action}", headers=viewer, json=body)
        assert (r.status_code, r.json()["role"]) == (403, "operator")
    assert (await api.engine.client.get(theirs)).status == "FAILED"


async def test_retention_policies_and_a_dry_run_sweep(api: Api) -> None:
    admin = await api.token("admin")
    policy = {"workflow": "job", "status_class": "completed", "retain_for_seconds": 3600,
              "purge_after_seconds": 86400}
    r = await api.http.put(f"{V1}/retention/policies", headers=admin, json=policy)
    assert r.status_code == 200
    listed = (await api.http.get(f"{V1}/retention/policies", headers=admin)).json()
    assert any(p["workflow"] == "job" and p["status_class"] == "completed" for p in listed)
    r = await api.http.put(f"{V1}/retention/policies", headers=admin, json={**policy, "status_class": "nope"})
    assert r.status_code == 422
    # PostgreSQL text cannot hold NUL: the fuzzed API test once got a 500 for this policy.
    r = await api.http.put(f"{V1}/retention/policies", headers=admin, json={**policy, "workflow": "j\x00b"})
    assert (r.status_code, r.json()["error"]) == (422, "InvalidInput"), r.text
    r = await api.http.post(f"{V1}/retention/run", headers=admin, json={"dry_run": True, "scope": "\x00"})
    assert (r.status_code, r.json()["error"]) == (422, "InvalidInput"), r.text
    sweep = (await api.http.post(f"{V1}/retention/run", headers=admin, json={"dry_run": True})).json()
    assert (sweep["dry_run"], sweep["archived"], sweep["purged"]) == (True, 0, 0)
    iid = await api.engine.client.start("job", {"name": "n"}, scope="acme")
    await api.engine.run_until_idle()
    await api.engine.client.signal(iid, "approve")  # it waits for approval, then ships and completes
    await api.engine.run_until_idle()
    await api.engine.move_clock(7200)
    narrowed = [(await api.http.post(f"{V1}/retention/run", headers=admin,
                                     json={"dry_run": True, "workflow": "job", "scope": s})).json()["archived"]
                for s in ("acme", "globex")]
    assert narrowed == [1, 0]
    operator = await api.token("operator")
    assert (await api.http.put(f"{V1}/retention/policies", headers=operator, json=policy)).status_code == 403
    assert (await api.http.post(f"{V1}/retention/run", headers=operator, json={"dry_run": True})).status_code == 403
    scoped = await api.token("admin", scope="acme")
    assert (await api.http.get(f"{V1}/retention/policies", headers=scoped)).status_code == 403
    assert (await api.http.get(f"{V1}/retention/policies")).status_code == 401


async def test_probe_stuck_and_stranded_reports_keep_to_the_visible_scopes(api: Api) -> None:
    mine = await api.start("p", scope="acme", fail=True)
    theirs = await api.start("q", scope="globex", fail=True)
    viewer = await api.token("viewer")
    probe = (await api.http.get(f"{V1}/operator/probe", headers=viewer)).json()
    assert probe["idle"] is True
    one = (await api.http.get(f"{V1}/operator/probe", headers=viewer, params={"instance_id": mine})).json()
    assert one["instance_id"] == mine
    acme = await api.token("viewer", scope="acme")
    assert (await api.http.get(f"{V1}/operator/probe", headers=acme)).status_code == 403
    r = await api.http.get(f"{V1}/operator/probe", headers=acme, params={"instance_id": theirs})
    assert r.status_code == 404
    stuck = (await api.http.get(f"{V1}/operator/stuck", headers=viewer, params={"older_than_seconds": 1})).json()
    for seconds in (0, 400 * 86400):  # the CLI's range (0s to a thousand years); the API refused both
        r = await api.http.get(f"{V1}/operator/stuck", headers=viewer, params={"older_than_seconds": seconds})
        assert r.status_code == 200, r.text
    seen = {i["instance_id"] for i in stuck["items"]}
    scoped = (await api.http.get(f"{V1}/operator/stuck", headers=acme, params={"older_than_seconds": 1})).json()
    assert {i["instance_id"] for i in scoped["items"]} <= {mine} and theirs not in str(scoped)
    assert seen >= {i["instance_id"] for i in scoped["items"]}
    await api.start("w")  # a waiting instance of job v1, whose plan no live worker serves
    stranded = (await api.http.get(f"{V1}/definitions/stranded", headers=viewer,
                                   params={"within_seconds": 60})).json()
    assert [(s["scope"], s["definition_id"], s["version"]) for s in stranded] == [("default", "job", 1)]
    assert stranded[0]["instances"] >= 1
    globex = await api.token("viewer", scope="globex")
    assert (await api.http.get(f"{V1}/definitions/stranded", headers=globex)).json() == []
    assert (await api.http.get(f"{V1}/definitions/stranded")).status_code == 401


async def test_the_stranded_report_counts_only_the_callers_scopes(api: Api) -> None:
    """Instances of acme run on the default scope's registration of job v1 (one pin): a token of one scope
    counts its own instances of that pin alone, in the API and on the UI's definitions page."""
    for name, scope in (("d1", "default"), ("d2", "default"), ("a1", "acme"), ("a2", "acme"), ("a3", "acme")):
        await api.start(name, scope=scope)  # each waits for its approval; no live worker serves job v1
    expected = {"*": 5, "default": 2, "acme": 3}
    for scope, count in expected.items():
        viewer = await api.token("viewer", scope=scope)
        stranded = (await api.http.get(f"{V1}/definitions/stranded", headers=viewer,
                                       params={"within_seconds": 60})).json()
        assert [(s["scope"], s["definition_id"], s["version"], s["instances"]) for s in stranded] == [
            ("default", "job", 1, count)], scope
    globex = await api.token("viewer", scope="globex")
    assert (await api.http.get(f"{V1}/definitions/stranded", headers=globex)).json() == []
    acme = (await api.token("viewer", scope="acme"))["Authorization"].removeprefix("Bearer ")
    assert (await api.http.post("/ui/login", data={"token": acme})).status_code == 303
    page = (await api.http.get("/ui/definitions")).text
    assert re.findall(r"default\">job</a></td><td>1</td><td>default</td><td>(\d+)</td>", page) == ["3"]


async def test_a_scoped_stuck_report_is_not_crowded_out_by_other_scopes(
    api: Api, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The report is capped (queries.MAX_REPORT rows, oldest instances first): read for the token's scopes, not
    capped over every scope and then filtered, so another tenant's many stuck commands do not hide this one's."""
    monkeypatch.setattr(queries, "MAX_REPORT", 2)
    for n in range(3):  # starts no worker has run: each START command is open, "old" past 0 s
        await api.engine.client.start("job", {"name": f"g{n}"}, scope="globex")
    mine = await api.engine.client.start("job", {"name": "m"}, scope="acme")
    acme = await api.token("viewer", scope="acme")
    scoped = await api.http.get(f"{V1}/operator/stuck", headers=acme, params={"older_than_seconds": 0})
    assert scoped.status_code == 200, scoped.text
    assert [(i["instance_id"], i["kind"], i["reason"]) for i in scoped.json()["items"]] == [(mine, "START", "old")]
    everyone = await api.http.get(f"{V1}/operator/stuck", headers=await api.token("viewer"),
                                  params={"older_than_seconds": 0})
    assert len(everyone.json()["items"]) == 2  # a token of every scope reads the one capped report, as before


async def test_a_stuck_report_cut_at_its_cap_says_so(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report holds at most queries.MAX_REPORT items; one that matched more says `more` (the API, the CLI's
    -o json and its table), where it looked the same as a report that held everything."""
    from tests.ops.test_cli_operations import run  # noqa: PLC0415 - the one CLI runner of the operator tests

    monkeypatch.setattr(queries, "MAX_REPORT", 2)
    for n in range(4):  # starts no worker has run: each START command is open, "old" past 0 s
        await api.engine.client.start("job", {"name": f"s{n}"}, scope="acme" if n else "default")
    for token in (await api.token("viewer"), await api.token("viewer", scope="acme")):
        r = await api.http.get(f"{V1}/operator/stuck", headers=token, params={"older_than_seconds": 0})
        assert (len(r.json()["items"]), r.json()["more"]) == (2, True), r.text
    r = await api.http.get(f"{V1}/operator/stuck", headers=await api.token("viewer", scope="default"),
                           params={"older_than_seconds": 0})
    assert (len(r.json()["items"]), r.json()["more"]) == (1, False)
    url = api.engine.store.url  # type: ignore[attr-defined]
    table = await run(url, "stuck", "--older-than", "0s")
    assert "the first 2 are shown: narrow the filters" in table.output, table.output
    assert (await run(url, "stuck", "--older-than", "0s", "-o", "json")).stdout.count('"more": true') == 1
