"""The HTTP methods of a path: HEAD answered wherever GET is, and the ``Allow`` header of a 405.

FastAPI's routes take exactly the methods they name, so ``HEAD`` (``curl -I``) was 405 everywhere while
every 405 advertised ``Allow: GET, HEAD``; and a 405 listed the methods of the first route of its path
only. `answer_head` answers a HEAD as the GET of the same address without its body, and
`allowed_methods` lists every method some route of the request's path takes.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from starlette.requests import Request
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["SAFE_METHODS", "allowed_methods", "answer_head"]

SAFE_METHODS = ("GET", "HEAD")
_PROBED = ("GET", "POST", "PUT", "PATCH", "DELETE")
_DISCONNECT: Message = {"type": "http.disconnect"}


class _HeadAsGet:
    """A HEAD request runs as a GET; the response's status and headers go out, its body does not. Once
    they are out the app is told the client left, so a stream (the UI's live events) ends at once."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        done = asyncio.Event()

        async def receive_until_done() -> Message:
            if done.is_set():
                return _DISCONNECT
            real, ended = asyncio.ensure_future(receive()), asyncio.ensure_future(done.wait())
            await asyncio.wait({real, ended}, return_when=asyncio.FIRST_COMPLETED)
            (ended if real.done() else real).cancel()
            return real.result() if real.done() else _DISCONNECT

        async def send_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                await send(message)
            elif message["type"] == "http.response.body" and not done.is_set():
                done.set()
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.app({**scope, "method": "GET"}, receive_until_done, send_headers)


def answer_head(app: FastAPI) -> None:
    """Answer HEAD wherever GET is answered (as HTTP expects)."""
    app.add_middleware(_HeadAsGet)


def allowed_methods(request: Request) -> str:
    """Every method a route of the request's path takes (HEAD wherever GET), as an ``Allow`` value."""
    found = []
    for method in _PROBED:
        probe = {**request.scope, "method": method}
        for route in request.app.router.routes:
            match, _ = route.matches(probe)
            if match is Match.FULL and (method in SAFE_METHODS or not isinstance(route, Mount)):  # files: GET
                found.append(method)
                break
    if "GET" in found:
        found.insert(1, "HEAD")
    return ", ".join(found)
