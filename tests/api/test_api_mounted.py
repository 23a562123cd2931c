"""The app mounted into a host FastAPI application, behind the host's own authentication."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from starlette.requests import Request

from stepstone.api import Principal, context_on, create_app
from stepstone.api.auth import TOKEN_COOKIE
from stepstone.testing import Engine, open_engine
from tests.api import workflows

USERS = {"ada": {"acme": "operator"}, "bob": {"acme": "viewer"}}


async def host_user(request: Request) -> Principal | None:
    """The host's hook: its session user (here a header its proxy sets) as a stepstone principal."""
    user = request.headers.get("x-user")
    return Principal(f"host:{user}", USERS[user]) if user in USERS else None


@pytest.fixture
async def host(database_url: str) -> AsyncIterator[tuple[Engine, httpx.AsyncClient]]:
    async with open_engine(database_url, workflows.registry) as engine:
        ctx = context_on(engine.store, registry=workflows.registry, authenticate=host_user)
        app = FastAPI()

        @app.get("/")
        async def home() -> dict[str, str]:
            return {"host": "yes"}

        app.mount("/ops", create_app(ctx))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://host") as http:
                yield engine, http
        finally:
            await ctx.close()


async def test_mounted_api_and_ui_use_the_hosts_users(host: tuple[Engine, httpx.AsyncClient]) -> None:
    engine, http = host
    iid = await engine.client.start("job", {"name": "m"}, scope="acme")
    await engine.run_until_idle()
    assert (await http.get("/")).json() == {"host": "yes"}
    assert (await http.get(f"/ops/api/v1/instances/{iid}")).status_code == 401
    bob = {"x-user": "bob"}
    assert (await http.get(f"/ops/api/v1/instances/{iid}", headers=bob)).json()["status"] == "WAITING"
    assert (await http.post(f"/ops/api/v1/instances/{iid}/cancel", headers=bob)).status_code == 403
    r = await http.post(f"/ops/api/v1/instances/{iid}/cancel", headers={"x-user": "ada"}, json={"reason": "host"})
    assert r.json()["status"] == "CANCELLED"
    history = await engine.client.history(iid)
    assert [h["actor"] for h in history if h["kind"] == "INSTANCE_CANCELLED"] == ["host:ada"]

    page = await http.get(f"/ops/ui/instances/{iid}", headers=bob)
    assert page.status_code == 200
    assert 'href="/ops/ui/static/stepstone.css"' in page.text and 'href="/ops/ui/"' in page.text
    assert (await http.get("/ops/ui/static/stepstone.js")).status_code == 200
    assert (await http.get("/ops/ui/", headers={})).headers["location"] == "/ops/ui/login"
    missing = await http.get("/ops/ui/nope", headers=bob)  # under the mount's UI: the error page
    assert (missing.status_code, missing.headers["content-type"].split(";")[0]) == (404, "text/html")
    # A file the UI does not have is its error page too, linking to the mount's UI (not .../ui/static/ui/).
    missing = await http.get("/ops/ui/static/nope", headers=bob)
    assert (missing.status_code, missing.headers["content-type"].split(";")[0]) == (404, "text/html")
    assert 'href="/ops/ui/"' in missing.text and 'href="/ops/ui/static/stepstone.css"' in missing.text
    schema = (await http.get("/ops/api/v1/openapi.json")).json()
    assert "/api/v1/instances" in schema["paths"]


async def test_behind_the_hosts_users_a_cookie_named_like_the_sign_in_does_not_key_the_forms(
    host: tuple[Engine, httpx.AsyncClient],
) -> None:
    """The UI's CSRF values are keyed by the app's secret behind a host's authentication (docs/ui.md, Safety):
    a `stepstone_token` cookie, which another site under the same domain can set, must not key them there, or
    a cross-site form could carry the value it computes from the cookie it set."""
    engine, http = host
    iid = await engine.client.start("job", {"name": "c"}, scope="acme")
    await engine.run_until_idle()
    planted = "sst_planted"
    forged = hmac.new(planted.encode(), b"stepstone-csrf\nhost:ada", hashlib.sha256).hexdigest()[:40]
    http.cookies.set(TOKEN_COOKIE, planted, path="/ops/ui")
    r = await http.post(f"/ops/ui/instances/{iid}/cancel", headers={"x-user": "ada"},
                        data={"csrf": forged, "reason": "forged"})
    assert r.status_code == 403, r.text[:300]
    assert (await engine.client.get(iid)).status == "WAITING"
