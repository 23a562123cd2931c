"""The UI's replay and migrate pages and the stranded report on the definitions page, through httpx."""

from __future__ import annotations

import re

from tests.api import workflows
from tests.api.conftest import Api


async def test_replay_a_failed_instance_from_its_step(api: Api) -> None:
    iid = await api.start("r", fail=True)
    csrf = await api.sign_in()
    assert "Replay or migrate…" in (await api.http.get(f"/ui/instances/{iid}")).text
    page = (await api.http.get(f"/ui/instances/{iid}/repair")).text
    assert "<option>charge</option>" in page
    workflows.FAILING.clear()
    r = await api.http.post(f"/ui/instances/{iid}/replay", data={"csrf": csrf, "step": "charge"})
    assert (r.status_code, r.headers["location"].split("&sig=")[0]) == (
        303, f"/ui/instances/{iid}?done=replaying+from+charge")
    await api.engine.run_until_idle()
    assert (await api.engine.client.get(iid)).status == "WAITING"
    r = await api.http.post(f"/ui/instances/{iid}/replay", data={"csrf": csrf, "step": "charge"})
    assert r.status_code == 409 and "cancel it" in r.text  # a waiting instance is not replayed


async def test_migrate_with_a_dry_run_first(api: Api) -> None:
    iid = await api.engine.client.start(workflows.order, {"order_id": "u-1"})
    await api.engine.run_until_idle()
    csrf = await api.sign_in()
    page = (await api.http.get(f"/ui/instances/{iid}/repair")).text
    assert '<option value="2">v2</option>' in page
    dry = await api.http.post(f"/ui/instances/{iid}/migrate", data={"csrf": csrf, "version": "2", "dry_run": "1"})
    assert "v2: would migrate; nothing was changed." in dry.text
    assert (await api.engine.client.get(iid)).version == 1
    r = await api.http.post(f"/ui/instances/{iid}/migrate", data={"csrf": csrf, "version": "2", "dry_run": "0"})
    assert r.headers["location"].split("&sig=")[0] == f"/ui/instances/{iid}?done=migrated+to+v2"
    assert (await api.engine.client.get(iid)).version == 2


async def test_the_definitions_page_shows_stranded_versions(api: Api) -> None:
    await api.start("s")
    await api.sign_in("viewer")
    page = (await api.http.get("/ui/definitions")).text
    rows = re.findall(r"<tr><td><a href=\"/ui/\?workflow=(\w+)&amp;scope=default\">", page)
    assert rows == ["job"]
    assert "<td>unknown</td>" in page and "never" not in page  # no heartbeat on record: not "never served"


async def test_maintenance_shows_what_is_stuck_and_sweeps_retention_with_a_dry_run(api: Api) -> None:
    admin = await api.token("admin")
    await api.http.put("/api/v1/retention/policies", headers=admin, json={
        "workflow": "job", "status_class": "completed", "retain_for_seconds": 0})
    done = await api.start("old")
    await api.engine.client.signal(done, "approve")
    await api.engine.run_until_idle()
    csrf = await api.sign_in("admin")
    page = (await api.http.get("/ui/maintenance")).text
    assert "Nothing is stuck." in page and 'id="probe">Idle' in page
    assert "<td>job</td><td>completed</td>" in page
    dry = await api.http.post("/ui/maintenance/retention", data={"csrf": csrf, "dry_run": "1"})
    assert "A sweep would archive 1 and purge 0 instance(s)" in dry.text
    again = await api.http.post("/ui/maintenance/retention", data={"csrf": csrf, "dry_run": "1"})
    assert "would archive 1 " in again.text  # the dry run archived nothing
    swept = await api.http.post("/ui/maintenance/retention", data={"csrf": csrf, "dry_run": "0"})
    assert "Archived 1, purged 0" in swept.text
    await api.sign_in("operator")
    page = (await api.http.get("/ui/maintenance")).text
    assert "Run a sweep now" not in page  # a sweep needs the admin role




async def test_a_number_no_column_holds_is_refused_by_the_forms(api: Api) -> None:
    """'²' passes `str.isdigit` but not `int` (a 500 from the repair page), and numbers past their column
    reached the store; each form now says what it wants, as for any other bad value."""
    iid = await api.engine.client.start(workflows.order, {"order_id": "u-2"})
    await api.engine.run_until_idle()
    csrf = await api.sign_in()
    for version in ("²", "99999999999"):
        r = await api.http.post(f"/ui/instances/{iid}/migrate", data={"csrf": csrf, "version": version, "dry_run": "1"})
        assert (r.status_code, "Choose a version to migrate to." in r.text) == (200, True), version
        r = await api.http.post("/ui/dead-letters/migrate", data={"csrf": csrf, "version": version, "every": "1"})
        assert (r.status_code, "choose the version to migrate to" in r.text) == (422, True), version
    r = await api.http.post("/ui/outbox/requeue", data={"csrf": csrf, "id": ["99999999999999999999", "²"]})
    assert (r.status_code, r.headers["location"].split("&sig=")[0]) == (
        303, "/ui/outbox?done=requeued+0+of+0+event%28s%29")
    assert (await api.engine.client.get(iid)).version == 1
