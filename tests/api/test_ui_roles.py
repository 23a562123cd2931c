"""What the UI offers a role: no action a role may not take is shown (the server would refuse it)."""

from __future__ import annotations

import re

from tests.api.conftest import Api
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
