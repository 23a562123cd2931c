"""Activating a version over the API (`POST /definitions/{scope}/{id}/{version}/activate`): the same operation
as `stepstone definitions activate`, its warnings about schedules in the answer, its roles and errors."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from stepstone.api import context_on, create_app
from stepstone.api.tokens import create_token
from stepstone.authoring.workflow import Registry
from stepstone.ops import definitions as definition_ops
from stepstone.scheduling import Schedule
from stepstone.testing import Engine, open_engine
from tests.scheduling.workflows import New, Old, typed

V1 = "/api/v1"


class Served:
    def __init__(self, engine: Engine, http: httpx.AsyncClient, ctx: Any) -> None:
        self.engine, self.http, self.ctx = engine, http, ctx

    async def token(self, role: str, scope: str = "*") -> dict[str, str]:
        token, _ = await create_token(self.ctx.management, role=role, scope=scope)
        return {"Authorization": f"Bearer {token}"}

    async def current(self, scope: str) -> int:
        selected = await self.engine.store.definitions.select_version(scope, "typed")
        assert selected is not None
        return selected[1]


@pytest.fixture
async def served(database_url: str) -> AsyncIterator[Served]:
    # v1 is recorded first, so it is the default scope's current version; v2 waits for an activation
    async with open_engine(database_url, Registry(typed(1, Old), typed(2, New))) as engine:
        ctx = context_on(engine.store)
        transport = httpx.ASGITransport(app=create_app(ctx))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                yield Served(engine, http, ctx)
        finally:
            await ctx.close()


async def test_an_operator_activates_a_version_and_hears_of_the_schedules_it_refuses(
    served: Served, caplog: pytest.LogCaptureFixture,
) -> None:
    """The API had no route to activate a version: only the CLI could, and only the CLI warned of the
    schedules whose input the new version refuses."""
    await served.engine.client.schedule(Schedule("t", "typed", every=60, input={"a": 1}))
    await served.engine.client.schedule(Schedule("beta-t", "typed", every=60, input={"a": 1}, scope="beta"))
    operator = await served.token("operator", "default")
    caplog.set_level(logging.WARNING, "stepstone.definitions")
    r = await served.http.post(f"{V1}/definitions/default/typed/2/activate", headers=operator)
    assert r.status_code == 200, r.text
    body = r.json()
    assert {k: body[k] for k in ("scope", "workflow", "version", "of_scope")} == {
        "scope": "default", "workflow": "typed", "version": 2, "of_scope": "default"}
    # beta follows the default scope's activation, but this token does not see beta: its schedule is not named
    [refused] = body["schedules_refused"]
    assert (refused["name"], refused["scope"]) == ("t", "default") and refused["problem"].startswith("input")
    assert await served.current("default") == 2
    logged = sorted(r.getMessage().split(" starts")[0] for r in caplog.records if r.name == "stepstone.definitions")
    assert logged == ["schedule beta-t (scope beta)", "schedule t (scope default)"]  # the server's log: all
    # A token of every scope hears of both; activating again is harmless
    everyone = await served.token("operator")
    again = (await served.http.post(f"{V1}/definitions/default/typed/2/activate", headers=everyone,
                                    json={})).json()
    assert sorted(x["name"] for x in again["schedules_refused"]) == ["beta-t", "t"]


async def test_a_tenant_scope_follows_the_default_scopes_version(served: Served) -> None:
    operator = await served.token("operator")
    r = await served.http.post(f"{V1}/definitions/acme/typed/1/activate", headers=operator,
                               json={"from_default": True})
    assert r.status_code == 200, r.text
    assert (r.json()["scope"], r.json()["of_scope"], r.json()["schedules_refused"]) == ("acme", "default", [])
    await served.engine.store.definitions.activate("default", "typed", 2)
    assert (await served.current("acme"), await served.current("default")) == (1, 2)


async def test_activation_takes_the_operator_role_and_maps_its_errors(served: Served) -> None:
    path = f"{V1}/definitions/default/typed/2/activate"
    assert (await served.http.post(path)).status_code == 401
    viewer = await served.http.post(path, headers=await served.token("viewer"))
    assert viewer.status_code == 403 and viewer.headers["content-type"] == "application/problem+json"
    assert viewer.json()["error"] == "Forbidden"
    # a scope the token does not see is not found, as an instance of it would be; so is the default scope's
    # version for a tenant's token (which does not see it)
    acme = await served.token("operator", "acme")
    assert (await served.http.post(path, headers=acme)).json()["error"] == "DefinitionNotFound"
    tenant = await served.http.post(f"{V1}/definitions/acme/typed/2/activate", headers=acme,
                                    json={"from_default": True})
    assert tenant.status_code == 404
    operator = await served.token("operator")
    missing = await served.http.post(f"{V1}/definitions/default/typed/3/activate", headers=operator)
    assert missing.status_code == 409 and missing.json()["error"] == "InvalidTransition"
    assert "only an AVAILABLE version can be activated" in missing.json()["detail"]
    typo = await served.http.post(path, headers=operator, json={"from-default": True})
    assert typo.status_code == 422  # an unknown field is refused, not taken for an activation of the scope's row
    assert await served.current("default") == 1  # nothing was activated


async def test_a_program_activating_through_the_operation_hears_of_refused_schedules(
    served: Served, caplog: pytest.LogCaptureFixture,
) -> None:
    """`store.definitions.activate` said nothing of the schedules; the operation says it (and returns them)."""
    await served.engine.client.schedule(Schedule("t", "typed", every=60, input={"a": 1}))
    caplog.set_level(logging.WARNING, "stepstone.definitions")
    done = await definition_ops.activate(served.engine.store, "default", "typed", 2)
    assert [r.name for r in done.schedules_refused] == ["t"]
    [line] = [r.getMessage() for r in caplog.records if r.name == "stepstone.definitions"]
    assert line.startswith("schedule t (scope default) starts typed v2 now") and "every tick will be skipped" in line


async def test_the_registry_write_returns_the_schedules_it_refuses(served: Served) -> None:
    """`store.definitions.activate`, the registry write the operation calls, checked nothing and returned
    None: a program calling it moved a schedule onto a version that refuses its input without a word. It
    returns them now, read in the activation's own transaction (the operation only logs them too)."""
    await served.engine.client.schedule(Schedule("t", "typed", every=60, input={"a": 1}))
    await served.engine.client.schedule(Schedule("kept", "typed", every=60, input={"a": 2}, scope="acme"))
    refused = await served.engine.store.definitions.activate("acme", "typed", 1, target_scope="default")
    assert refused == []  # acme keeps v1, which takes its input
    [t] = await served.engine.store.definitions.activate("default", "typed", 2)
    assert (t.name, t.scope) == ("t", "default") and t.problem.startswith("input")
    assert await served.engine.store.definitions.activate("default", "typed", 2) == [t]  # again: the same
    assert await served.engine.store.definitions.activate("default", "typed", 1) == []
    # Removing a scope's activation moves its schedules too: acme follows the default scope's v2 again.
    await served.engine.store.definitions.activate("default", "typed", 2)
    [kept] = await served.engine.store.definitions.deactivate("acme", "typed")
    assert (kept.name, kept.scope) == ("kept", "acme") and kept.problem.startswith("input")
    assert await served.engine.store.definitions.deactivate("acme", "typed") == [kept]  # again: the same


async def test_a_start_of_a_version_the_server_lacks_names_the_servers_app(served: Served) -> None:
    """The database selects typed v1, which this server (started without --app) does not hold: the refusal
    named "this client's registry", which from the API is no registry the caller has or knows of."""
    operator = await served.token("operator")
    r = await served.http.post(f"{V1}/instances", headers=operator, json={"workflow": "typed", "input": {"a": 1}})
    assert (r.status_code, r.json()["error"]) == (404, "DefinitionNotFound"), r.text
    assert r.json()["detail"] == ("workflow definition 'typed' v1 is the version scope default selects, and the "
                                  "server's --app lacks it (or holds another structure under that version)")
