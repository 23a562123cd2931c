"""The API while its database is unreachable: every request answers 503 DatabaseUnavailable (problem+json, "try
again later", docs/api.md), whether the token is looked up by a route or, for a request with a body, by
`api.body_guard` before the body is read."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from stepstone.api import context_on, create_app
from stepstone.api.auth import TokenAuth
from stepstone.testing import open_engine
from tests.api import workflows
from tests.outages import Outage


class _TokensDown(Outage):
    """The management queries, with the token lookup failing as an unreachable server's does while down."""

    async def token_by_hash(self, token_hash: str) -> Any:
        self.check("token_by_hash")
        return await self.real.token_by_hash(token_hash)

    async def active_token_count(self) -> Any:
        self.check("token_by_hash")
        return await self.real.active_token_count()


@pytest.fixture
async def http(database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with open_engine(database_url, workflows.registry) as engine:
        ctx = context_on(engine.store, registry=workflows.registry)
        tokens = _TokensDown(ctx.management, ("token_by_hash",))
        ctx.authenticate = TokenAuth(tokens, cookie=False)
        ctx.management = tokens
        tokens.down = True
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)),
                                         base_url="http://test") as client:
                yield client
        finally:
            await ctx.close()


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/api/v1/instances", None),
    ("POST", "/api/v1/instances", {"workflow": "job", "input": {"name": "a"}}),
    ("POST", "/api/v1/bulk/retry", {"filter": {"status": ["FAILED"]}, "dry_run": True}),
    ("PUT", "/api/v1/retention/policies", {"status_class": "completed", "retain_for_seconds": 60}),
])
async def test_a_request_during_an_outage_is_503_whoever_looks_its_token_up(
    http: httpx.AsyncClient, method: str, path: str, body: Any,
) -> None:
    r = await http.request(method, path, headers={"Authorization": "Bearer sst_anything"}, json=body)
    assert (r.status_code, r.headers["content-type"]) == (503, "application/problem+json"), r.text
    assert r.json()["error"] == "DatabaseUnavailable"


async def test_an_outage_does_not_tell_anyone_where_the_database_is(http: httpx.AsyncClient) -> None:
    """/health answers without a token, and any request meets the outage before its token is known: the 503 says
    what to do, not the database's host and port (the driver's message named them, and the problem carried them)."""
    for path in ("/api/v1/health", "/api/v1/instances"):
        r = await http.get(path, headers={"Authorization": "Bearer sst_anything"})
        assert (r.status_code, r.json()["error"]) == (503, "DatabaseUnavailable"), r.text
        assert r.json()["detail"] == "the database cannot be reached now; try again later"
        assert "test" not in r.text.replace("urn:stepstone", ""), r.text  # the outage's host is named "test"
