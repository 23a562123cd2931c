"""The HTTP long poll gives its fetch up when the client goes away: it cancels the fetch and awaits its end. A
cancellation of the request's own task arriving during that await goes through, where
`contextlib.suppress(asyncio.CancelledError)` swallowed it and the handler answered as if not cancelled."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from stepstone.external import http
from tests._lingering import linger_when_cancelled


class GoneClient:
    """A request whose client has gone away."""

    async def is_disconnected(self) -> bool:
        return True


async def test_a_cancellation_while_the_given_up_fetch_ends_is_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "_DISCONNECT_CHECK", 0)  # look at the client at once
    cancelled, release = asyncio.Event(), asyncio.Event()
    request: Any = GoneClient()
    fetch: Any = linger_when_cancelled(cancelled, release)  # a fetch that is slow to end once cancelled
    poll = asyncio.create_task(http._unless_gone(request, fetch))
    await cancelled.wait()  # the client is gone: the poll cancelled the fetch and awaits its end
    poll.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await poll
    assert poll.cancelled()


async def test_a_fetch_given_up_for_a_gone_client_answers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "_DISCONNECT_CHECK", 0)
    cancelled, release = asyncio.Event(), asyncio.Event()
    release.set()
    request: Any = GoneClient()
    fetch: Any = linger_when_cancelled(cancelled, release)
    assert await http._unless_gone(request, fetch) == []
    assert cancelled.is_set()
