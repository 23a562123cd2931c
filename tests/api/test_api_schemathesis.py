"""Schemathesis against the OpenAPI schema: no generated request gets a 500.

The app runs in a thread of its own (its own event loop and store) on a free loopback port, since
schemathesis drives it with blocking calls; the caller is an admin, so every operation is reached.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from stepstone.api import open_app
from stepstone.api.tokens import create_token
from tests._pg import PgServer
from tests.api import workflows
from tests.api.serving import served

schemathesis = pytest.importorskip("schemathesis")
EXAMPLES = 60
"""Generated requests per operation: the whole schema took 76 s on two shared cores."""


def _serve(url: str, box: dict[str, Any], ready: threading.Event, stop: threading.Event) -> None:
    async def main() -> None:
        async with open_app(url, registry=workflows.registry) as app:
            ctx = app.state.stepstone
            box["token"], _ = await create_token(ctx.management, role="admin")
            box["instance"] = await ctx.client("test").start("job", {"name": "seed"})
            await ctx.client("test").start("expense", {"employee": "seed", "amount": 1})
            async with served(app) as base:
                box["base"] = base
                ready.set()
                await asyncio.to_thread(stop.wait)

    try:
        asyncio.run(main())
    finally:
        ready.set()


@pytest.fixture(scope="module")
def live_api(pg_server: PgServer) -> Iterator[dict[str, Any]]:
    name = pg_server.take_clone()
    box: dict[str, Any] = {}
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=_serve, args=(pg_server.url_for(name), box, ready, stop), daemon=True)
    thread.start()
    try:
        assert ready.wait(60) and "base" in box, "the app did not start"
        yield box
    finally:
        stop.set()
        thread.join(30)
        pg_server.drop_database(name)


# First pass only: the generated requests test the API's validation and error mapping, the same on any
# server; the endpoints' SQL runs against the second PostgreSQL in tests/api's other tests.
@pytest.mark.first_pass_only
def test_no_generated_request_gets_a_server_error(live_api: dict[str, Any]) -> None:
    schema = schemathesis.openapi.from_url(f"{live_api['base']}/api/v1/openapi.json")
    headers = {"Authorization": f"Bearer {live_api['token']}"}
    checked: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def no_server_error(case: Any) -> None:
            response = case.call(headers=headers, timeout=10)
            where = f"{case.method} {case.formatted_path}"
            assert response.status_code < 500, f"{where}: {response.status_code} {response.text}"
            if response.status_code >= 400:
                kind = response.headers["content-type"]  # a list of values in schemathesis's response
                assert kind == ["application/problem+json"], f"{where}: {kind} {response.text}"

        no_server_error()
        checked.append(f"{operation.method.upper()} {operation.path}")
    assert len(checked) >= 30, checked
