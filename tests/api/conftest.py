"""Fixtures of the API tests: an engine, the app on its store with token auth, and tokens per role."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI

from stepstone.api import ApiContext, context_on, create_app
from stepstone.api.tokens import create_token
from stepstone.testing import Engine, open_engine
from tests.api import workflows


@dataclass
class Api:
    engine: Engine
    ctx: ApiContext
    app: FastAPI
    http: httpx.AsyncClient

    async def token(self, role: str, scope: str = "*", name: str | None = None,
                    groups: tuple[str, ...] = ()) -> dict[str, str]:
        """Authorization headers of a fresh token granting `role` in `scope`."""
        token, _ = await create_token(self.ctx.management, role=role, scope=scope, name=name, groups=groups)
        return {"Authorization": f"Bearer {token}"}

    async def sign_in(self, role: str = "operator") -> str:
        """Sign the UI in with a fresh token of `role` in every scope; the CSRF value of its forms."""
        token = (await self.token(role))["Authorization"].removeprefix("Bearer ")
        assert (await self.http.post("/ui/login", data={"token": token})).status_code == 303
        found = re.search(r'name="csrf" value="([0-9a-f]+)"', (await self.http.get("/ui/tasks")).text)
        assert found
        return found.group(1)

    async def start(self, name: str, *, scope: str = "default", fail: bool = False) -> str:
        if fail:
            workflows.FAILING.add(name)
        iid = await self.engine.client.start("job", {"name": name}, scope=scope)
        await self.engine.run_until_idle()
        return iid


@pytest.fixture(autouse=True)
def _clean_failing() -> Iterator[None]:
    workflows.FAILING.clear()
    yield
    workflows.FAILING.clear()


async def _api(database_url: str, *, read_only: bool = False) -> AsyncIterator[Api]:
    async with open_engine(database_url, workflows.registry, concurrency=2) as engine:
        ctx = context_on(engine.store, registry=workflows.registry, read_only=read_only)
        app = create_app(ctx)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                yield Api(engine, ctx, app, http)
        finally:
            await ctx.close()


@pytest.fixture
async def api(database_url: str) -> AsyncIterator[Api]:
    async for value in _api(database_url):
        yield value


@pytest.fixture
async def read_only_api(database_url: str) -> AsyncIterator[Api]:
    async for value in _api(database_url, read_only=True):
        yield value
