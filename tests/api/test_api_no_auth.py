"""`stepstone serve --no-auth`: every request is the local admin, so only its own loopback address and
pages may ask; a web page elsewhere (cross-site, or DNS rebinding) may not."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from stepstone.api import NO_AUTH, context_on, create_app
from stepstone.testing import Engine, open_engine
from tests.api import workflows
from tests.api.serving import served


@pytest.fixture
async def local(database_url: str) -> AsyncIterator[tuple[Engine, str]]:
    """The engine, and the base URL of a no-auth app served on 127.0.0.1."""
    async with open_engine(database_url, workflows.registry) as engine:
        ctx = context_on(engine.store, registry=workflows.registry, authenticate=NO_AUTH)
        try:
            async with served(create_app(ctx)) as base:
                yield engine, base
        finally:
            await ctx.close()


async def test_another_host_or_a_cross_site_change_is_refused(local: tuple[Engine, str]) -> None:
    """A cross-site form-encoded POST ran a retention sweep and cancelled instances, and a request naming
    `attacker.example` (DNS rebinding) was answered as the admin."""
    engine, base = local
    iid = await engine.client.start("job", {"name": "x"})
    port = base.rsplit(":", 1)[1]
    async with httpx.AsyncClient(base_url=f"{base}/api/v1", timeout=10) as http:
        assert (await http.get("/whoami")).status_code == 200
        for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
            assert (await http.get("/whoami", headers={"Host": host})).status_code == 200, host
        for host in (f"attacker.example:{port}", "127.0.0.1:1", "127.0.0.1"):
            r = await http.get("/whoami", headers={"Host": host})
            assert (r.status_code, r.json()["error"]) == (403, "NotLocal"), host
            assert "answers only requests to its own loopback address" in r.json()["detail"]
        form = {"content-type": "application/x-www-form-urlencoded"}
        r = await http.post("/retention/run", headers={"Origin": "http://evil.example", **form}, content=b"")
        assert (r.status_code, r.json()["error"]) == (403, "NotLocal")
        assert "sent from another site" in r.json()["detail"]
        r = await http.post(f"/instances/{iid}/cancel", headers=form, content=b"")  # no Origin: still a form
        assert (r.status_code, r.json()["error"]) == (403, "NotLocal")
        assert "application/json only" in r.json()["detail"]
        r = await http.post(f"/instances/{iid}/cancel", headers={"Origin": "null"}, json={})
        assert r.status_code == 403
        assert (await engine.client.get(iid)).status != "CANCELLED"
        # A local program (no Origin) or the server's own page (its own origin) sending JSON may.
        assert (await http.post("/retention/run", json={"dry_run": True})).status_code == 200
        r = await http.post(f"/instances/{iid}/cancel", headers={"Origin": base}, json={"reason": "mine"})
        assert r.status_code == 200, r.text
    assert (await engine.client.get(iid)).status == "CANCELLED"


async def test_the_ui_of_a_no_auth_server_refuses_another_host_and_origin(local: tuple[Engine, str]) -> None:
    engine, base = local
    iid = await engine.client.start("job", {"name": "y"})
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        assert (await http.get("/ui/")).status_code == 200
        r = await http.get("/ui/", headers={"Host": "attacker.example"})
        assert (r.status_code, r.headers["content-type"].split(";")[0]) == (403, "text/html")
        page = (await http.get(f"/ui/instances/{iid}/confirm/cancel")).text
        csrf = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        r = await http.post(f"/ui/instances/{iid}/cancel", data={"csrf": csrf},
                            headers={"Origin": "http://evil.example"})
        assert r.status_code == 403
        assert (await engine.client.get(iid)).status != "CANCELLED"
        r = await http.post(f"/ui/instances/{iid}/cancel", data={"csrf": csrf}, headers={"Origin": base})
        assert r.status_code == 303
    assert (await engine.client.get(iid)).status == "CANCELLED"


async def test_the_ui_of_a_no_auth_server_may_not_be_framed_by_another_site(local: tuple[Engine, str]) -> None:
    """A page elsewhere cannot send a form as the local admin, but it could show the UI in a frame and have the
    user click its own buttons there (the frame's requests name this host and origin, and carry the page's CSRF
    value): every UI page, its error pages too, says that only its own origin may frame it."""
    engine, base = local
    iid = await engine.client.start("job", {"name": "f"})
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        for path in ("/ui/", f"/ui/instances/{iid}/confirm/cancel", "/ui/maintenance", "/ui/nope"):
            r = await http.get(path)
            assert r.headers.get("x-frame-options") == "SAMEORIGIN", (path, r.status_code)
            assert r.headers.get("content-security-policy") == "frame-ancestors 'self'", path
