"""The UI's bulk migrate of failed instances (the incidents page) and its retention policy form,
through httpx: a check first that answers each instance, then the migration; a policy set and shown."""

from __future__ import annotations

import re

from tests.api import workflows
from tests.api.conftest import Api


async def _failed_order(api: Api, order_id: str) -> str:
    workflows.FAILING.add(order_id)
    iid = await api.engine.client.start(workflows.order, {"order_id": order_id})
    await api.engine.run_until_idle()
    assert (await api.engine.client.get(iid)).status == "FAILED"
    return iid


def _outcomes(html: str) -> list[tuple[str, str]]:
    return re.findall(r'data-outcome="([^"]+)"><a class="mono" href="/ui/instances/([0-9a-f-]+)"', html)


async def test_migrate_every_failed_order_after_a_check_then_retry_them_on_v2(api: Api) -> None:
    a = await _failed_order(api, "a")
    b = await _failed_order(api, "b")
    await api.start("j", fail=True)  # a failed job: not of the filter
    csrf = await api.sign_in()
    page = (await api.http.get("/ui/dead-letters", params={"workflow": "order"})).text
    assert 'action="/ui/dead-letters/migrate"' in page and "Migrate every failed instance of workflow order" in page
    form = {"csrf": csrf, "every": "1", "workflow": "order", "version": "2", "dry_run": "1"}
    check = (await api.http.post("/ui/dead-letters/migrate", data=form)).text
    assert "Migration check to v2: 2 would migrate, 0 refused, 0 skipped; nothing was changed" in check
    assert sorted(_outcomes(check)) == sorted([("would migrate", a), ("would migrate", b)])
    assert "Migrate the 2 that can move" in check
    assert [(await api.engine.client.get(i)).version for i in (a, b)] == [1, 1]
    hidden = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">',
                             check.split('action="/ui/dead-letters/migrate">', 1)[1].split("</form>", 1)[0]))
    assert hidden == {"csrf": csrf, "every": "1", "workflow": "order", "version": "2", "dry_run": "0"}
    done = (await api.http.post("/ui/dead-letters/migrate", data=hidden)).text
    assert "Migration results: 2 of 2 migrated to v2, 0 refused, 0 skipped" in done
    assert [(await api.engine.client.get(i)).version for i in (a, b)] == [2, 2]
    workflows.FAILING.clear()
    await api.engine.client.retry(a)
    await api.engine.run_until_idle()
    await api.engine.client.signal(a, "nudge")
    await api.engine.run_until_idle()
    assert (await api.engine.client.get(a)).state["got"] == "filed by v2"


async def test_migrate_a_selection_answers_each_one_and_refuses_what_cannot_move(api: Api) -> None:
    order = await _failed_order(api, "o")
    job = await api.start("j", fail=True)
    csrf = await api.sign_in()
    form = {"csrf": csrf, "instance": [order, job], "version": "2", "dry_run": "1"}
    check = (await api.http.post("/ui/dead-letters/migrate", data=form)).text
    assert "1 would migrate, 1 refused" in check
    assert "this server&#39;s workflows have no job v2" in check
    assert sorted(_outcomes(check)) == sorted([("would migrate", order), ("refused", job)])
    r = await api.http.post("/ui/dead-letters/migrate", data={**form, "version": "two"})
    assert r.status_code == 422 and "choose the version to migrate to" in r.text
    assert (await api.engine.client.get(order)).version == 1
    await api.sign_in("viewer")
    page = (await api.http.get("/ui/dead-letters")).text
    assert order in page
    viewer_csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert viewer_csrf
    r = await api.http.post("/ui/dead-letters/migrate", data={**form, "csrf": viewer_csrf.group(1), "dry_run": "0"})
    assert r.status_code == 403 and "needs the operator role" in r.text
    assert (await api.engine.client.get(order)).version == 1


async def test_a_read_only_ui_offers_no_migration_and_refuses_one(read_only_api: Api) -> None:
    api = read_only_api
    await _failed_order(api, "r")
    csrf = await api.sign_in()
    page = (await api.http.get("/ui/dead-letters")).text
    assert "/ui/dead-letters/migrate" not in page
    r = await api.http.post("/ui/dead-letters/migrate", data={"csrf": csrf, "every": "1", "version": "2"})
    assert r.status_code == 405


async def test_the_maintenance_page_sets_a_retention_policy(api: Api) -> None:
    csrf = await api.sign_in("admin")
    page = (await api.http.get("/ui/maintenance")).text
    assert 'action="/ui/maintenance/retention/policy"' in page
    r = await api.http.post("/ui/maintenance/retention/policy", data={
        "csrf": csrf, "workflow": "job", "status_class": "failed", "retain_days": "2", "purge_days": "0.5"})
    assert r.status_code == 200
    assert "job failed: archive after 2 days, 0:00:00, purge 12:00:00 later." in r.text
    assert "<td>job</td><td>failed</td><td>2 days, 0:00:00</td><td>12:00:00</td>" in r.text
    r = await api.http.post("/ui/maintenance/retention/policy", data={
        "csrf": csrf, "workflow": "job", "status_class": "failed", "retain_days": ""})
    assert "job failed: archive after never, purge 12:00:00 later." in r.text  # blank purge: kept
    for bad, says in (({"status_class": "archived"}, "status_class"), ({"retain_days": "soon"}, "number of days"),
                      ({"retain_days": "-1"}, "greater than or equal to 0"), ({"purge_days": "nan"}, "purge"),
                      ({"workflow": "job "}, "job "),  # it was trimmed, and the policy set for 'job'
                      ({"workflow": "  "}, "workflow")):
        r = await api.http.post("/ui/maintenance/retention/policy", data={
            "csrf": csrf, "workflow": "job", "status_class": "failed", **bad})
        assert r.status_code == 422 and says in r.text, bad
    operator_csrf = await api.sign_in("operator")
    page = (await api.http.get("/ui/maintenance")).text
    assert "retention/policy" not in page
    r = await api.http.post("/ui/maintenance/retention/policy", data={
        "csrf": operator_csrf, "workflow": "job", "status_class": "failed", "retain_days": "1"})
    assert r.status_code == 403 and "needs the admin role" in r.text
