"""The web UI served by the same app, through httpx: sign-in, pages, confirmations, CSRF, read-only."""

from __future__ import annotations

import re

import httpx
import pytest

from stepstone.api import operations as ops
from stepstone.core.model import FAILURE_KINDS, STATUSES
from stepstone.ui import routes
from stepstone.ui.diagram import END_NODE, diagram, render_svg
from tests.api import workflows
from tests.api.conftest import Api
from tests.api.serving import served


async def _sign_in(api: Api, role: str = "operator", scope: str = "*") -> None:
    token = (await api.token(role, scope))["Authorization"].removeprefix("Bearer ")
    r = await api.http.post("/ui/login", data={"token": token})
    assert r.status_code == 303
    assert "httponly" in r.headers["set-cookie"].lower() and "samesite=strict" in r.headers["set-cookie"].lower()


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', html)
    assert found, "the page has a form with a CSRF value"
    return found.group(1)


async def test_pages_need_a_sign_in_and_a_wrong_token_is_refused(api: Api) -> None:
    r = await api.http.get("/ui/")
    assert (r.status_code, r.headers["location"]) == (303, "/ui/login")
    r = await api.http.post("/ui/login", data={"token": "sst_nope"})
    assert r.status_code == 401
    assert "unknown or revoked" in r.text
    assert (await api.http.get("/")).headers["location"] == "ui/"


async def test_list_and_instance_page_show_the_failed_step_in_the_graph(api: Api) -> None:
    failed = await api.start("bad", fail=True)
    fine = await api.start("good")
    await _sign_in(api, "viewer")
    page = await api.http.get("/ui/", params={"status": "FAILED"})
    assert page.status_code == 200
    assert failed[-8:] in page.text and fine[-8:] not in page.text
    assert 'data-live="list"' in page.text

    detail = (await api.http.get(f"/ui/instances/{failed}")).text
    assert re.search(r'<g class="node kind-action failed visited" data-step="charge">', detail)
    assert 'class="node kind-wait" data-step="approval"' in detail
    assert "Declined" in detail  # the error, shown on the page
    # where it raised, folded away under it and under each failed attempt in the history
    assert detail.count('<details><summary>Traceback</summary><pre class="traceback">Traceback (most recent call '
                        'last):\n  File ') == 3  # the error, its STEP_FAILED and INSTANCE_FAILED entries
    assert '&#34;, line ' in detail and ", in charge\n    raise Declined(f&#34;card declined for" in detail
    assert "&#34;frames&#34;" not in detail  # not as JSON beside it
    assert "Retry…" not in detail  # a viewer gets no actions
    assert "actions need operator" in detail

    detail = (await api.http.get(f"/ui/instances/{fine}")).text
    assert 'class="node kind-wait current visited" data-step="approval"' in detail
    assert 'class="edge executed" d="' in detail and 'data-edge="charge->approval"' in detail
    assert "replace /log" in detail or "add /log" in detail  # a readable patch in the timeline


async def test_the_list_filters_by_every_status_an_instance_can_have(api: Api) -> None:
    """The list offered six statuses and dropped any other from its filter: `?status=TIMED_OUT` (or a
    click on the count of timed-out instances) listed every instance."""
    late = await api.engine.client.start("job", {"name": "late"}, deadline=5)
    fine = await api.start("fine")
    await api.engine.advance(seconds=10)
    assert (await api.engine.client.get(late)).status == "TIMED_OUT"
    await _sign_in(api, "viewer")
    page = (await api.http.get("/ui/", params={"status": "TIMED_OUT"})).text
    assert late[-8:] in page and fine[-8:] not in page
    assert all(f'<option value="{status}"' in page for status in STATUSES)


async def test_a_filter_page_refuses_a_parameter_it_does_not_take(api: Api) -> None:
    """The UI's filter pages ignored a parameter they do not take: a misspelled filter (`?stauts=FAILED`)
    listed every instance, where the API answers 422 naming it."""
    failed = await api.start("bad", fail=True)
    fine = await api.start("fine")
    await _sign_in(api, "viewer")
    for path, name, takes in [("/ui/", "stauts", "archived, business_key, cursor, scope, status, workflow"),
                              ("/ui/tasks", "mdoe", "cursor, mode, text, workflow"),
                              ("/ui/dead-letters", "scpoe", "cursor, scope, workflow")]:
        r = await api.http.get(path, params={name: "FAILED"})
        assert r.status_code == 422 and r.headers["content-type"].startswith("text/html"), (path, r.text)
        assert f"{name}: not a parameter of this page (it takes: {takes})" in r.text, path
    # What the pages take, and a redirect's status message, are as before.
    page = await api.http.get("/ui/", params={"status": "FAILED", "done": "x", "sig": "y"})
    assert page.status_code == 200 and failed[-8:] in page.text and fine[-8:] not in page.text


async def test_the_list_takes_several_statuses_as_the_api_does(api: Api) -> None:
    """The list kept one value of a repeated status (`?status=FAILED&status=TIMED_OUT` listed the timed-out
    instances only), while the API's list takes every one; an unknown status listed every instance."""
    workflows.FAILING.add("bad")
    failed = await api.engine.client.start_many("job", [{"name": "bad"}] * 51)
    late = await api.engine.client.start("job", {"name": "late"}, deadline=5)
    fine = await api.start("fine")
    await api.engine.advance(seconds=10)
    await _sign_in(api, "viewer")
    both = [("status", "FAILED"), ("status", "timed_out")]  # (in any case, as the API's)
    page = (await api.http.get("/ui/", params=both)).text
    assert late[-8:] in page and fine[-8:] not in page
    assert '<option value="FAILED" selected>' in page and '<option value="TIMED_OUT" selected>' in page
    older = re.findall(r'<a rel="next" href="/ui/\?([^"]+)"', page)
    assert len(older) == 1 and older[0].startswith("status=FAILED&amp;status=timed_out&amp;cursor="), older
    rest = (await api.http.get("/ui/?" + older[0].replace("&amp;", "&"))).text  # the next page keeps both
    assert all(i[-8:] in page + rest for i in [*failed, late]) and fine[-8:] not in rest
    assert '<option value="TIMED_OUT" selected>' in rest
    one = re.findall(r'<a class="status-failed" href="/ui/\?([^"]+)"', page)
    assert one == ["status=FAILED"]  # a count's link lists its status alone
    unknown = await api.http.get("/ui/", params=[("status", "FAILED"), ("status", "BROKEN")])
    assert unknown.status_code == 422 and "BROKEN is not a status" in unknown.text


async def test_retry_goes_through_a_confirmation_and_needs_the_csrf_value(api: Api) -> None:
    iid = await api.start("again", fail=True)
    await _sign_in(api)
    confirm = await api.http.get(f"/ui/instances/{iid}/confirm/retry")
    assert confirm.status_code == 200 and "Retry this instance?" in confirm.text
    r = await api.http.post(f"/ui/instances/{iid}/retry", data={"csrf": "0" * 40})
    assert r.status_code == 403
    assert (await api.engine.client.get(iid)).status == "FAILED"
    workflows.FAILING.clear()
    r = await api.http.post(f"/ui/instances/{iid}/retry", data={"csrf": _csrf(confirm.text)})
    assert (r.status_code, r.headers["location"].split("&sig=")[0]) == (
        303, f"/ui/instances/{iid}?done=retry+scheduled")
    await api.engine.run_until_idle()
    assert (await api.engine.client.get(iid)).status == "WAITING"

    form = await api.http.get(f"/ui/instances/{iid}/signal")
    assert "approve" in form.text
    r = await api.http.post(f"/ui/instances/{iid}/signal",
                            data={"csrf": _csrf(form.text), "name": "approve", "payload": "{not json"})
    assert r.status_code == 422 and "not JSON" in r.text
    r = await api.http.post(f"/ui/instances/{iid}/signal",  # past the parser's depth: a RecursionError was a 500
                            data={"csrf": _csrf(form.text), "name": "approve", "payload": "[" * 100_000})
    assert r.status_code == 422 and "nested too deeply" in r.text
    r = await api.http.post(f"/ui/instances/{iid}/signal",
                            data={"csrf": _csrf(form.text), "name": "approve", "payload": '{"by": "ui"}'})
    assert r.status_code == 303
    await api.engine.run_until_idle()
    assert (await api.engine.client.get(iid)).status == "COMPLETED"
    history = await api.engine.client.history(iid)
    [token] = await api.ctx.management.list_tokens(include_revoked=False)
    assert {h["actor"] for h in history if h["kind"] == "INSTANCE_RETRIED"} == {
        f"token:{token.name}"}


async def test_bulk_retry_of_a_selection_reports_each_item(api: Api) -> None:
    first = await api.start("b1", fail=True)
    second = await api.start("b2", fail=True)
    ok = await api.start("b3")
    await _sign_in(api)
    letters = await api.http.get("/ui/dead-letters")
    assert first[-8:] in letters.text and second[-8:] in letters.text
    workflows.FAILING.discard("b1")
    confirm = await api.http.post("/ui/dead-letters/confirm", data={"csrf": _csrf(letters.text),
                                                                    "instance": [first, second, ok]})
    assert "Retry 3 instance(s)?" in confirm.text
    result = await api.http.post("/ui/dead-letters/retry", data={"csrf": _csrf(confirm.text),
                                                                 "instance": [first, second, ok]})
    assert result.status_code == 200
    assert "Retry results: 2 of 3 retried" in result.text
    # the one that was not FAILED, with its reason
    assert "only a FAILED or COMPENSATION_FAILED instance can be retried" in result.text


async def test_incidents_list_a_saga_whose_compensation_gave_up_and_a_retry_resumes_it(api: Api) -> None:
    """The incidents page listed FAILED instances only: a COMPENSATION_FAILED saga, an incident a bulk
    retry resumes, was not there to select."""
    workflows.FAILING.add("rome")
    workflows.FAILING_UNDO.add("rome")
    try:
        iid = await api.engine.client.start("trip", {"trip": "rome"})
        await api.engine.run_until_idle()
    finally:
        workflows.FAILING.discard("rome")
        workflows.FAILING_UNDO.discard("rome")
    assert (await api.engine.client.get(iid)).status == "COMPENSATION_FAILED"
    await _sign_in(api)
    letters = (await api.http.get("/ui/dead-letters")).text
    gave_up = letters.split('id="gave-up-h"', 1)[1]
    assert iid[-8:] in gave_up and f'name="instance" value="{iid}"' in gave_up
    confirm = await api.http.post("/ui/dead-letters/confirm", data={"csrf": _csrf(letters), "instance": [iid]})
    result = await api.http.post("/ui/dead-letters/retry", data={"csrf": _csrf(confirm.text), "instance": [iid]})
    assert "Retry results: 1 of 1 retried" in result.text
    await api.engine.run_until_idle()
    info = await api.engine.client.get(iid)
    assert (info.status, info.state["undone"]) == ("COMPENSATED", True)


async def test_another_scope_is_a_not_found_page_and_read_only_refuses_posts(read_only_api: Api) -> None:
    api = read_only_api
    theirs = await api.start("t", scope="globex", fail=True)
    await _sign_in(api, "admin", scope="acme")
    r = await api.http.get(f"/ui/instances/{theirs}")
    assert r.status_code == 404 and "InstanceNotFound" in r.text
    await _sign_in(api, "admin")
    page = await api.http.get(f"/ui/instances/{theirs}")
    assert "read-only" in page.text and "Retry…" not in page.text
    r = await api.http.post(f"/ui/instances/{theirs}/retry", data={"csrf": _csrf(page.text)})
    assert r.status_code == 405
    assert (await api.engine.client.get(theirs)).status == "FAILED"
    api.http.cookies.clear()  # whoever asks, as the API's 405 comes before its 401: not the sign-in page
    for path in (f"/ui/instances/{theirs}/retry", "/ui/maintenance/retention", "/ui/outbox/requeue"):
        r = await api.http.post(path, data={})
        assert (r.status_code, r.headers["content-type"].split(";")[0]) == (405, "text/html"), path


async def test_the_live_stream_says_when_a_watched_instance_changes(api: Api) -> None:
    iid = await api.start("live", fail=True)
    await _sign_in(api)
    workflows.FAILING.clear()
    lines: list[str] = []
    cookie = {"Cookie": f"stepstone_token={api.http.cookies['stepstone_token']}"}
    async with (served(api.app) as base, httpx.AsyncClient(base_url=base, headers=cookie) as http,
                http.stream("GET", "/ui/events", params={"instance": iid}, timeout=10) as stream):
        assert stream.headers["content-type"].startswith("text/event-stream")
        async for line in stream.aiter_lines():
            lines.append(line)
            if line.startswith("retry:"):
                await api.engine.client.retry(iid)
                await api.engine.run_until_idle()
            if line.startswith("data:"):
                break
    assert f"data: {iid}" in lines


async def test_definitions_and_outbox_pages(api: Api) -> None:
    await api.start("d")
    await _sign_in(api, "viewer", scope="default")
    listing = await api.http.get("/ui/definitions")
    assert 'href="/ui/definitions/default/job/1"' in listing.text
    plan = await api.http.get("/ui/definitions/default/job/1")
    assert plan.status_code == 200 and 'data-step="approval"' in plan.text
    assert (await api.http.get("/ui/definitions/globex/job/1")).status_code == 404
    assert (await api.http.get("/ui/definitions/default/job/99999999999")).status_code == 404  # past int4: was a 500
    outbox = await api.http.get("/ui/outbox")
    assert "needs a role in scope *" in outbox.text
    await _sign_in(api, "viewer")
    outbox = await api.http.get("/ui/outbox")
    assert "Pending" in outbox.text and "No dead events." in outbox.text


def test_the_diagram_marks_forks_joins_and_the_end() -> None:
    plan = {"start": "ship", "steps": [
        {"name": "ship", "kind": "fork", "branches": {"a": "left", "b": "right"}},
        {"name": "left", "kind": "action", "next": ["joined"]},
        {"name": "right", "kind": "action", "next": ["joined"]},
        {"name": "joined", "kind": "join", "fork": "ship", "next": ["done"]},
        {"name": "done", "kind": "action", "next": []},
    ]}
    history = [{"step": "ship", "position": ""}, {"step": "left", "position": "ship/a"},
               {"step": "right", "position": "ship/b"}, {"step": "joined", "position": ""},
               {"step": "done", "position": ""}]
    d = diagram(plan, [{"path": "", "step": None, "status": "COMPLETED"}], history, status="COMPLETED")
    assert d.place["ship"][0] == 0 and d.place["left"][0] == d.place["right"][0] == 1
    assert d.place["joined"][0] == 2 and d.place[END_NODE][0] == 4
    assert all(e.executed for e in d.edges)
    half = diagram(plan, [{"path": "ship/b", "step": "right", "status": "FAILED"}], history[:2])
    assert half.failed == {"right"} and "done" not in half.visited
    assert {(e.source, e.target) for e in half.edges if e.executed} == {("ship", "left")}
    assert render_svg(half).count("<g class=") == 6


async def test_retry_every_match_of_a_filter_confirms_an_honest_count(api: Api) -> None:
    here = await api.start("h1", fail=True)
    also = await api.start("h2", fail=True)
    elsewhere = await api.start("e1", scope="other", fail=True)
    await _sign_in(api)
    letters = await api.http.get("/ui/dead-letters", params={"scope": "default"})
    assert here[-8:] in letters.text and elsewhere[-8:] not in letters.text
    assert "Retry every failed instance of scope default…" in letters.text
    workflows.FAILING.clear()
    confirm = await api.http.post("/ui/dead-letters/confirm", data={"csrf": _csrf(letters.text), "every": "1",
                                                                    "scope": "default"})
    assert "Retry 2 instance(s)?" in confirm.text
    assert (await api.engine.client.get(here)).status == "FAILED"  # the count was a dry run
    result = await api.http.post("/ui/dead-letters/retry", data={"csrf": _csrf(confirm.text), "every": "1",
                                                                 "scope": "default"})
    assert "Retry results: 2 of 2 retried" in result.text
    assert here[-8:] in result.text and also[-8:] in result.text
    await api.engine.run_until_idle()
    assert [(await api.engine.client.get(i)).status for i in (here, also, elsewhere)] == [
        "WAITING", "WAITING", "FAILED"]


async def test_the_list_stream_names_no_instance_of_another_scope(api: Api) -> None:
    """The list's live stream sent the id of every instance that settled: a viewer of acme learned the
    id of a default-scope instance an operator cancelled."""
    theirs = await api.start("theirs")
    ours = await api.start("ours", scope="acme")
    await _sign_in(api, "viewer", scope="acme")
    cookie = {"Cookie": f"stepstone_token={api.http.cookies['stepstone_token']}"}
    said: list[str] = []
    async with (served(api.app) as base, httpx.AsyncClient(base_url=base, headers=cookie) as http,
                http.stream("GET", "/ui/events", timeout=10) as stream):
        async for line in stream.aiter_lines():
            if line.startswith("retry:"):  # listening: settle theirs first, then ours
                await api.engine.client.cancel(theirs, "not yours to know")
                await api.engine.client.cancel(ours, "yours")
                await api.engine.run_until_idle()
            if line.startswith("data:"):
                said.append(line)
                break
    assert said == [f"data: {ours}"]


async def test_the_graph_of_an_instance_pinned_to_the_default_scopes_definition(api: Api) -> None:
    """An acme instance of a workflow registered in the default scope only got an empty graph: the page
    looked its plan up in the instance's scope, not in the scope of the definition it is pinned to."""
    iid = await api.start("elsewhere", scope="acme", fail=True)
    await _sign_in(api, "viewer", scope="acme")
    detail = (await api.http.get(f"/ui/instances/{iid}")).text
    assert 'aria-label="empty plan"' not in detail
    assert re.search(r'<g class="node kind-action failed visited" data-step="charge">', detail)


def _counts(html: str) -> dict[str, str]:
    """The list's counts, status -> shown number, with 'all'."""
    shown = html.split('aria-label="Instances by status">', 1)[1].split("</ul>", 1)[0]
    found = dict(re.findall(r'class="status-(\w+)"[^>]*>\w+ <b>([\d,+]+)</b>', shown))
    return {**found, "all": re.findall(r">All <b>([\d,+]+)</b>", shown)[0]}


async def test_the_counts_count_what_the_list_lists(api: Api) -> None:
    """The list's counts took the workflow filter only: `?scope=acme` counted every scope (a click on
    "failed 2" listed nothing) and `?business_key=jk-1` listed one instance but counted all of them."""
    await api.start("d1", fail=True)
    await api.start("d2", fail=True)
    ours = await api.start("a1", scope="acme")
    keyed = await api.engine.client.start("job", {"name": "k"}, business_key="jk-1")
    await api.engine.run_until_idle()
    await _sign_in(api, "viewer")
    assert _counts((await api.http.get("/ui/")).text) == {"failed": "2", "waiting": "2", "all": "4"}
    page = (await api.http.get("/ui/", params={"scope": "acme"})).text
    assert ours[-8:] in page and _counts(page) == {"waiting": "1", "all": "1"}
    page = (await api.http.get("/ui/", params={"business_key": "jk-1"})).text
    assert keyed[-8:] in page and _counts(page) == {"waiting": "1", "all": "1"}
    assert _counts((await api.http.get("/ui/", params={"scope": "nowhere"})).text) == {"all": "0"}
    viewer = await api.token("viewer", "acme")  # a scope it cannot see counts nothing, as it lists nothing
    for params, expected in [({"scope": "acme"}, {"WAITING": 1}), ({"scope": "default"}, {}),
                             ({"business_key": "jk-1"}, {})]:
        counted = (await api.http.get("/api/v1/instances/counts", headers=viewer, params=params)).json()
        assert counted["counts"] == expected, params


async def test_the_dead_lettered_commands_are_narrowed_by_workflow_and_scope(api: Api) -> None:
    """The incidents page narrowed the failed instances by its filter but listed every dead-lettered
    command of the visible scopes."""
    ours = await api.start("j1", fail=True)
    other_scope = await api.start("j2", scope="acme", fail=True)
    workflows.FAILING.add("o1")
    other_workflow = await api.engine.client.start("order", {"order_id": "o1"})
    await api.engine.run_until_idle()
    async with api.engine.store.pool.acquire() as conn:  # a command dead-lettered after crashing workers
        await conn.execute("UPDATE stepstone.commands SET state = 'DEAD' WHERE instance_id = ANY($1::uuid[])",
                           [ours, other_scope, other_workflow])
    await _sign_in(api, "viewer")

    def dead(html: str) -> str:
        return html.split("<h2>Dead-lettered commands</h2>", 1)[1]

    every = dead((await api.http.get("/ui/dead-letters")).text)
    assert all(i[-8:] in every for i in (ours, other_scope, other_workflow))
    narrowed = dead((await api.http.get("/ui/dead-letters", params={"workflow": "job", "scope": "default"})).text)
    assert ours[-8:] in narrowed and other_scope[-8:] not in narrowed and other_workflow[-8:] not in narrowed


async def test_a_read_only_server_shows_no_action_form(read_only_api: Api) -> None:
    """Under --read-only the confirmation and signal pages still drew their Retry, Cancel and Send signal
    buttons (posting them was refused with 405)."""
    api = read_only_api
    failed = await api.start("ro", fail=True)
    waiting = await api.start("ro-wait")
    await _sign_in(api, "admin")
    for path, action in [(f"{failed}/confirm/retry", f"{failed}/retry"),
                         (f"{waiting}/confirm/cancel", f"{waiting}/cancel"),
                         (f"{waiting}/signal", f"{waiting}/signal")]:
        page = await api.http.get(f"/ui/instances/{path}")
        assert page.status_code == 200, path
        assert f'action="/ui/instances/{action}"' not in page.text and "This server is read-only." in page.text


async def test_every_error_of_a_ui_page_is_a_page(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path parameter FastAPI refused (422), a path under /ui no route has (404), a method a route does
    not take (405) and an unexpected error (500) came back as problem+json, not as the error page."""
    await _sign_in(api, "viewer")
    for path, status in [("/ui/definitions/default/job/abc", 422), ("/ui/nope", 404),
                         (f"/ui/instances/{'0' * 8}/retry", 405), ("/ui/static/nope", 404),
                         ("/ui/static/../routes.py", 404)]:
        r = await api.http.get(path)
        assert (r.status_code, r.headers["content-type"].split(";")[0]) == (status, "text/html"), path
        assert '<p class="error" role="alert">' in r.text
        assert 'href="/ui/"' in r.text, path  # the UI's own links, not the static mount's
    r = await api.http.post("/ui/static/stepstone.css")  # a file takes GET and HEAD only: a page too
    assert (r.status_code, r.headers["content-type"].split(";")[0]) == (405, "text/html")
    for path in ("/api/v1/definitions/default/job/abc", "/api/v1/nope", "/nope"):  # the API's stay problem+json
        r = await api.http.get(path, headers=await api.token("viewer"))
        assert r.headers["content-type"] == "application/problem+json", path

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(ops, "stranded", broken)
    transport = httpx.ASGITransport(app=api.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", cookies=api.http.cookies) as http:
        r = await http.get("/ui/definitions")
    assert (r.status_code, r.headers["content-type"].split(";")[0]) == (500, "text/html")
    assert "InternalError" in r.text and "a bug" not in r.text


async def test_failures_only_finds_failures_past_the_first_page_of_history(api: Api,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """"Failures only" filtered the first 500 entries the page had read, so a failure recorded after them
    was missing (the API's failed_only and `stepstone history --failed` asked the store for failures)."""
    iid = await api.start("again", fail=True)
    for _ in range(3):
        await api.engine.client.retry(iid)
        await api.engine.run_until_idle()
    failures = [h for h in await api.engine.client.history(iid) if h["kind"] in FAILURE_KINDS]
    monkeypatch.setattr(routes, "_HISTORY_ON_PAGE", 4)  # the failures go on past the first 4 entries
    await _sign_in(api, "viewer")
    timeline = (await api.http.get(f"/ui/instances/{iid}", params={"failed": "1"})).text.split('id="hist-h"')[1]
    shown = re.findall(r'<li class="bad">\s*<time datetime="[^"]+">[^<]*</time>\s*<b>([a-z ]+)</b>', timeline)
    assert shown == [h["kind"].lower().replace("_", " ") for h in failures][:4]
    assert len(failures) > 4 and "Showing the first 4 entries" in timeline


async def test_cancel_offers_to_compensate_first(api: Api) -> None:
    """The UI's cancel had no compensate option (the CLI's --compensate, the API's "compensate"): a saga
    could only be cancelled as it stood. A COMPENSATION_FAILED saga, as `cancel --compensate` on the CLI,
    is left as it is when asked to compensate, and given up (CANCELLED) when not."""
    workflows.FAILING.add("t-ui")
    workflows.FAILING_UNDO.add("t-ui")
    try:
        iid = await api.engine.client.start("trip", {"trip": "t-ui"})
        await api.engine.run_until_idle()
    finally:
        workflows.FAILING_UNDO.discard("t-ui")
    assert (await api.engine.client.get(iid)).status == "COMPENSATION_FAILED"
    await _sign_in(api, "operator")
    page = (await api.http.get(f"/ui/instances/{iid}/confirm/cancel")).text
    assert 'name="compensate" value="1"' in page
    csrf = _csrf(page)
    r = await api.http.post(f"/ui/instances/{iid}/cancel", data={"csrf": csrf, "reason": "x", "compensate": "1"})
    assert r.status_code == 303, r.text
    assert "done=nothing+changed%2C+still+compensation_failed" in r.headers["location"], r.headers
    assert (await api.engine.client.get(iid)).status == "COMPENSATION_FAILED"
    r = await api.http.post(f"/ui/instances/{iid}/cancel", data={"csrf": csrf, "reason": "give up"})
    assert r.status_code == 303 and "done=cancelled" in r.headers["location"]
    assert (await api.engine.client.get(iid)).status == "CANCELLED"
