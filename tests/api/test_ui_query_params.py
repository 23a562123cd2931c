"""Every UI page refuses a query parameter it does not take, as the API's routes and the UI's filter pages
do: 422 on the error page, naming the parameter and the ones the page takes; and a repeat of one that takes
one value, as the API does. Every form (POST) refuses any query."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
from fastapi.routing import APIRoute

from tests.api.conftest import Api
from tests.api.serving import served

TAKES = {  # what each page takes besides a redirect's signed status message (done, sig), which every page does
    "/ui/": "archived, business_key, cursor, scope, status, workflow",
    "/ui/login": "none",
    "/ui/instances/{instance_id}": "failed",
    "/ui/instances/{instance_id}/confirm/{action}": "none",
    "/ui/instances/{instance_id}/signal": "none",
    "/ui/instances/{instance_id}/repair": "none",
    "/ui/definitions": "cursor",
    "/ui/definitions/{scope}/{definition_id}/{version}": "none",
    "/ui/outbox": "none",
    "/ui/events": "instance, stamp",
    "/ui/tasks": "cursor, mode, text, workflow",
    "/ui/tasks/{task_id}": "none",
    "/ui/dead-letters": "cursor, scope, workflow",
    "/ui/maintenance": "none",
}


def _get_routes(routes: Iterable[Any], method: str = "GET") -> Iterator[str]:
    """The paths of the routes of `method`, through included routers (FastAPI 0.165 keeps them behind
    `original_router`)."""
    for route in routes:
        if isinstance(route, APIRoute) and method in route.methods:
            yield route.path
        elif hasattr(route, "original_router"):
            yield from _get_routes(route.original_router.routes, method)


async def test_every_page_refuses_a_parameter_it_does_not_take(api: Api) -> None:
    """The pages without filters ignored any parameter (`/ui/outbox?stauts=1` was the outbox page), while
    the filter pages and the API refuse it."""
    iid = await api.start("fine")
    task_iid = await api.engine.client.start("expense", {"employee": "ann", "amount": 75})
    await api.engine.run_until_idle()
    [task] = await api.engine.client.instance_tasks(task_iid)
    values = {"instance_id": iid, "action": "retry", "scope": "default", "definition_id": "job", "version": "1",
              "task_id": str(task["id"])}
    token = (await api.token("admin"))["Authorization"].removeprefix("Bearer ")
    assert (await api.http.post("/ui/login", data={"token": token})).status_code == 303
    pages = sorted(path for path in _get_routes(api.app.routes) if path.startswith("/ui"))
    assert set(pages) == set(TAKES), "a new UI page: say in TAKES which parameters it takes"
    cookie = {"Cookie": f"stepstone_token={token}"}
    # Served, not through httpx's ASGI transport, which waits for a whole response: the live stream has no end.
    async with served(api.app) as base, httpx.AsyncClient(base_url=base, headers=cookie, timeout=30) as http:
        for path in pages:
            url = re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path)
            async with http.stream("GET", url, params={"stauts": "FAILED", "done": "x", "sig": "y"}) as r:
                status, kind = r.status_code, r.headers["content-type"]
                text = (await r.aread()).decode() if status == 422 else ""
            assert status == 422 and kind.startswith("text/html"), (url, status)
            assert f"stauts: not a parameter of this page (it takes: {TAKES[path]})" in text, (url, text)
            if path != "/ui/events":  # the page itself, and a redirect's status message, are as before
                assert (await http.get(url, params={"done": "x", "sig": "y"})).status_code == 200, url


async def test_a_page_refuses_a_repeat_of_a_parameter_that_takes_one_value(api: Api) -> None:
    """As the API does: `?workflow=a&workflow=b` listed one workflow's instances, silently (the last one's
    value is read). `status` of the instance list takes several values, as the API's does."""
    await api.sign_in("admin")
    for url, name in (("/ui/?workflow=job&workflow=other", "workflow"), ("/ui/tasks?mode=mine&mode=all", "mode"),
                      ("/ui/dead-letters?done=x&done=y", "done")):
        r = await api.http.get(url)
        assert (r.status_code, r.headers["content-type"][:9]) == (422, "text/html"), url
        assert f"{name}: given 2 times; this parameter takes one value" in r.text, (url, r.text)
    assert (await api.http.get("/ui/?status=FAILED&status=COMPLETED")).status_code == 200


async def test_every_form_refuses_a_query(api: Api) -> None:
    """The forms (POST routes) did not look at their query at all: `POST /ui/instances/<id>/cancel?stauts=1`
    cancelled. None takes one: 422, nothing done."""
    iid = await api.start("fine")
    assert (await api.engine.client.get(iid)).status == "WAITING"
    csrf = await api.sign_in("admin")
    values = {"instance_id": iid, "task_id": "1", "action": "claim"}
    forms = sorted(path for path in _get_routes(api.app.routes, "POST") if path.startswith("/ui"))
    assert "/ui/instances/{instance_id}/cancel" in forms and "/ui/login" in forms
    for path in forms:
        url = re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path)
        r = await api.http.post(url, params={"stauts": "1"}, data={"csrf": csrf, "token": "x"})
        assert r.status_code == 422, (url, r.status_code)
        assert "stauts: not a parameter of this page (it takes: none)" in r.text, (url, r.text)
    assert (await api.engine.client.get(iid)).status == "WAITING"  # not cancelled
