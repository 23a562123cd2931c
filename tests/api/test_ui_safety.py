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


async def test_sign_in_and_sign_out_from_another_site_are_refused(api: Api) -> None:
    """POST /ui/login took a form from anywhere (login CSRF: signing the victim in as the attacker) and
    POST /ui/logout a cross-site Origin; the browser's Origin (or Sec-Fetch-Site) says where it is from."""
    token = (await api.token("viewer"))["Authorization"].removeprefix("Bearer ")
    for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Origin": "http://test.evil.example"}):
        r = await api.http.post("/ui/login", data={"token": token}, headers=headers)
        assert (r.status_code, r.headers["content-type"].split(";")[0]) == (403, "text/html"), headers
        assert "set-cookie" not in r.headers
    r = await api.http.post("/ui/login", data={"token": token}, headers={"Origin": "http://test"})
    assert r.status_code == 303 and "stepstone_token=" in r.headers["set-cookie"]
    r = await api.http.post("/ui/logout", headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "set-cookie" not in r.headers
    assert (await api.http.get("/ui/")).status_code == 200  # still signed in
    r = await api.http.post("/ui/logout", headers={"Origin": "http://test", "Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 303 and 'stepstone_token=""' in r.headers["set-cookie"]
