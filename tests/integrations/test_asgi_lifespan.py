"""The FastAPI lifespan: a client for the app's lifetime, an in-process worker when asked, drained on shutdown."""

from __future__ import annotations

from typing import Annotated, Any

import pytest

from stepstone.client import Client
from stepstone.integrations.asgi import lifespan, problem_responses, stepstone_client
from tests.scheduling import workflows

fastapi = pytest.importorskip("fastapi", reason="FastAPI is in the test extra")
testclient = pytest.importorskip("fastapi.testclient", reason="FastAPI is in the test extra")


def _app(database_url: str, *, worker: bool) -> Any:
    app = fastapi.FastAPI(lifespan=lifespan(workflows.registry, database_url=database_url, worker=worker,
                                            concurrency=2))

    @app.post("/reports")
    async def make(
        body: dict[str, Any], client: Annotated[Client, fastapi.Depends(stepstone_client)],
    ) -> dict[str, Any]:
        iid = await client.start("report", body)
        if not worker:
            return {"id": iid}
        info = await client.wait_for(iid, timeout=20)  # woken by the instance's own notification
        return {"id": iid, "status": info.status, "state": info.state}

    return app


def test_the_app_starts_workflows_and_runs_them_in_process(database_url: str) -> None:
    app = _app(database_url, worker=True)
    with testclient.TestClient(app) as http:
        answer = http.post("/reports", json={"kind": "daily"}).json()
        assert answer["status"] == "COMPLETED" and answer["state"]["data"] == {"built": True}
        assert app.state.stepstone_worker is not None and app.state.stepstone_worker.alive
    assert not app.state.stepstone_worker.alive  # drained and stopped with the app


def test_without_a_worker_the_app_only_starts(database_url: str) -> None:
    app = _app(database_url, worker=False)
    with testclient.TestClient(app) as http:
        iid = http.post("/reports", json={"kind": "x"}).json()["id"]
    assert app.state.stepstone_worker is None
    import asyncio  # noqa: PLC0415

    async def status() -> str:
        client = await Client.connect(database_url)
        try:
            return (await client.get(iid)).status
        finally:
            await client.close()

    assert asyncio.run(status()) == "PENDING"


def test_problem_responses_answer_a_routes_stepstone_errors_as_the_api_does(database_url: str) -> None:
    app = _app(database_url, worker=False)
    problem_responses(app)

    @app.get("/reports/{iid}")
    async def show(iid: str, client: Annotated[Client, fastapi.Depends(stepstone_client)]) -> dict[str, Any]:
        return {"status": (await client.get(iid)).status}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("not stepstone's")

    with testclient.TestClient(app, raise_server_exceptions=False) as http:
        refused = http.post("/reports", json={"kind": 5})  # the state model wants a text
        assert refused.status_code == 422, refused.text
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["error"] == "InvalidInput" and "kind" in refused.json()["detail"]
        missing = http.get("/reports/01a24b29-0000-7000-8000-000000000000")
        assert missing.status_code == 404 and missing.json()["error"] == "InstanceNotFound"
        assert http.get("/boom").status_code == 500  # other errors are the app's own


def test_a_worker_needs_the_registry() -> None:
    with pytest.raises(ValueError, match="needs the registry"):
        lifespan(worker=True)
