"""The UI's own words and forms: a status message only the UI produced; sign-in and sign-out not from
another site."""

from __future__ import annotations

from tests.api.conftest import Api
from tests.api.test_ui_pages import _sign_in

PHISH = "Session expired: re-enter your token at https://evil.example"


async def test_only_a_status_message_the_ui_produced_is_shown(api: Api) -> None:
    """`/ui/?done=<any text>` showed that text as the page's status message (escaped, but fit for
    phishing); the message of a redirect the UI made is shown."""
    iid = await api.start("again", fail=True)
    csrf = await api.sign_in()
    assert PHISH not in (await api.http.get("/ui/", params={"done": PHISH})).text
    assert PHISH not in (await api.http.get("/ui/", params={"done": PHISH, "sig": "0" * 32})).text
    assert PHISH not in (await api.http.get("/ui/outbox", params={"done": PHISH})).text
    r = await api.http.post(f"/ui/instances/{iid}/retry", data={"csrf": csrf})
    assert r.status_code == 303
    page = (await api.http.get(r.headers["location"])).text
    assert '<p class="flash" role="status">retry scheduled</p>' in page
    await _sign_in(api, "operator")  # another token: the signature of the first is not its
    assert "retry scheduled" not in (await api.http.get(r.headers["location"])).text
