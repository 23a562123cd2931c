"""The UI's live stream of an instance named by another spelling of its id (upper case, no hyphens)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from stepstone.api.live import Broadcaster
from stepstone.ui import routes
from tests.api.conftest import Api
from tests.api.serving import served


@pytest.mark.parametrize("spelled", [str, str.upper, lambda i: i.replace("-", "")], ids=["as is", "upper", "bare"])
async def test_the_stream_of_another_spelling_of_an_id_hears_its_notification(
        api: Api, monkeypatch: pytest.MonkeyPatch, spelled: Callable[[str], str]) -> None:
    """The stream compared each settle notification (the id as the database spells it) with the id as the
    page gave it: an upper-case or unhyphenated id never matched, so the stream saw the instance change
    only by re-reading its status and update time, and said so in the page's spelling. Here the check
    of the status is put out of play (its interval out of reach, the instance unchanged): the
    notification alone must make the stream say "changed", naming the instance as the database does."""
    monkeypatch.setattr(routes, "_LIVE_POLL_SECONDS", 3600.0)
    ctx = api.app.state.stepstone
    ctx.broadcaster = Broadcaster(api.engine.store)  # as a served app has (api/hosting.py)
    iid = await api.start("live")  # waiting for its approval
    token = (await api.token("operator"))["Authorization"].removeprefix("Bearer ")
    assert (await api.http.post("/ui/login", data={"token": token})).status_code == 303
    cookie = {"Cookie": f"stepstone_token={api.http.cookies['stepstone_token']}"}
    said: list[str] = []
    try:
        async with (served(api.app) as base, httpx.AsyncClient(base_url=base, headers=cookie) as http,
                    http.stream("GET", "/ui/events", params={"instance": spelled(iid)}, timeout=30) as stream):
            async for line in stream.aiter_lines():
                if line.startswith("retry:"):  # subscribed: the notification of the instance, as it settles
                    channel = f"stepstone.settled.{api.engine.store.schema}"[:63]
                    await api.engine.store.pool.execute("SELECT pg_notify($1, $2)", channel, iid)
                elif line:
                    said.append(line)  # the line the notification made: an event, or a keep-alive before
                    if not line.startswith("event:"):
                        break
    finally:
        await ctx.broadcaster.close()
    assert said == ["event: changed", f"data: {iid}"]
