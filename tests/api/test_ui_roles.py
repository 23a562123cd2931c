"""What the UI offers a role: no action a role may not take is shown (the server would refuse it)."""

from __future__ import annotations

import re

import httpx
import pytest

from stepstone.api.tokens import create_token, revoke_token
from stepstone.ui import routes
from tests.api.conftest import Api
from tests.api.serving import served
from tests.api.test_ui_pages import _sign_in

ACTIONS = ("Retry every failed instance", "Check the migration", "Retry selected…")


def _posts(html: str) -> list[str]:
    """The targets of the page's POST forms, but signing out (every page has it)."""
    return [a for a in re.findall(r'method="post" action="([^"]+)"', html) if a != "/ui/logout"]


async def test_a_viewer_sees_no_action_button_or_form(api: Api) -> None:
    """A viewer was shown the incidents page's retry and migrate buttons, and the confirmation and signal
    pages' forms (the server refused them with 403); docs/ui.md: a viewer sees no action buttons."""
    failed = await api.start("bad", fail=True)
    waiting = await api.start("wait")
    await _sign_in(api, "viewer")
    incidents = (await api.http.get("/ui/dead-letters")).text
    assert failed[-8:] in incidents
    assert not [label for label in ACTIONS if label in incidents]
    assert _posts(incidents) == []
    for path in (f"{failed}/confirm/retry", f"{waiting}/confirm/cancel", f"{waiting}/signal", f"{waiting}/repair"):
        page = await api.http.get(f"/ui/instances/{path}")
        assert page.status_code == 200, path
        assert _posts(page.text) == [], path
        assert "Your role here is viewer: actions need operator." in page.text, path
    maintenance = (await api.http.get("/ui/maintenance")).text
    assert "Run a sweep now" not in maintenance and "Set a policy" not in maintenance


async def test_an_operator_still_sees_every_action(api: Api) -> None:
    failed = await api.start("bad", fail=True)
    waiting = await api.start("wait")
    await _sign_in(api, "operator")
    incidents = (await api.http.get("/ui/dead-letters")).text
    assert all(label in incidents for label in ACTIONS)
    for path, action in [(f"{failed}/confirm/retry", f"{failed}/retry"),
                         (f"{waiting}/confirm/cancel", f"{waiting}/cancel"),
                         (f"{waiting}/signal", f"{waiting}/signal")]:
        assert f'action="/ui/instances/{action}"' in (await api.http.get(f"/ui/instances/{path}")).text
    maintenance = (await api.http.get("/ui/maintenance")).text
    assert "Run a sweep now" not in maintenance  # a sweep is the admin's
    await _sign_in(api, "admin")
    assert "Run a sweep now" in (await api.http.get("/ui/maintenance")).text


async def test_the_live_stream_ends_when_its_token_is_revoked(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """An open /ui/events kept delivering after its token was revoked (docs/api.md: 401 from then on)."""
    monkeypatch.setattr(routes, "_LIVE_POLL_SECONDS", 0.05)  # the interval it re-checks at: test quickly
    token, record = await create_token(api.ctx.management, role="viewer")
    cookie = {"Cookie": f"stepstone_token={token}"}
    lines: list[str] = []
    async with (served(api.app) as base, httpx.AsyncClient(base_url=base, headers=cookie) as http,
                http.stream("GET", "/ui/events", timeout=10) as stream):
        assert stream.status_code == 200
        async for line in stream.aiter_lines():  # ends when the server ends the stream
            lines.append(line)
            if line.startswith("retry:"):
                await revoke_token(api.ctx.management, str(record.id))
            assert lines.count(": keep-alive") < 40, "the stream went on after its token was revoked"
        assert (await http.get("/ui/events")).status_code == 303  # the reconnection: to the sign-in page
    assert lines[0].startswith("retry:")


async def test_the_outbox_page_offers_no_requeue_form_to_a_viewer(api: Api) -> None:
    """The outbox page rendered its requeue form, a checkbox per dead event, for a viewer (only its button was
    left out): the page offers no action the role may not take."""
    await _sign_in(api, "viewer")
    page = await api.http.get("/ui/outbox")
    assert page.status_code == 200 and "Dead events" in page.text
    assert _posts(page.text) == []
