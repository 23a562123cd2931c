"""Every UI page refuses a query parameter it does not take, as the API's routes and the UI's filter pages
do: 422 on the error page, naming the parameter and the ones the page takes."""

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


def _get_routes(routes: Iterable[Any]) -> Iterator[str]:
    """The GET routes' paths, through included routers (FastAPI 0.165 keeps them behind `original_router`)."""
    for route in routes:
        if isinstance(route, APIRoute) and "GET" in route.methods:
            yield route.path
        elif hasattr(route, "original_router"):
            yield from _get_routes(route.original_router.routes)


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
