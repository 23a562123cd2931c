"""The HTTP endpoint of external tasks, in process (httpx on the ASGI app), on a real PostgreSQL:
the same operations as the Python client, errors as JSON with a status that says what to do."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from stepstone.external import ExternalTasks
from stepstone.external.http import MAX_BODY_BYTES, create_app
from stepstone.testing import Engine, open_engine
from tests.external import workflows
from tests.external.workflows import payment, shipping


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, workflows.registry, concurrency=2, lease_seconds=30) as e:
        yield e


@pytest.fixture
async def http(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    tasks = ExternalTasks(engine.store, poll_interval=0.05)
    transport = httpx.ASGITransport(app=create_app(tasks, token="s3cret"))  # noqa: S106 - a test token
    async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                 headers={"authorization": "Bearer s3cret"}) as client:
        yield client
    await tasks.close()


async def test_fetch_complete_over_http(engine: Engine, http: httpx.AsyncClient) -> None:
    iid = await engine.client.start(payment, {"order_id": "H-1", "amount": 7})
    await engine.run_until_idle()
    got = await http.post("/external-tasks/fetch-and-lock",
                          json={"worker_id": "curl", "topics": ["payments"], "max_tasks": 2, "lock_duration": 60})
    assert got.status_code == 200
    [task] = got.json()["tasks"]
    assert task["payload"] == {"order_id": "H-1", "amount": 7} and task["instance_id"] == iid

    extended = await http.post(f"/external-tasks/{task['id']}/extend-lock",
                               json={"lock_token": task["lock_token"], "lock_duration": 120})
    assert extended.status_code == 200 and extended.json()["lock_until"] > task["lock_until"]

    wrong = await http.post(f"/external-tasks/{task['id']}/complete",
                            json={"lock_token": "00000000-0000-0000-0000-000000000000"})
    assert wrong.status_code == 409 and wrong.json()["error"] == "lock_lost"

    done = await http.post(f"/external-tasks/{task['id']}/complete",
                           json={"lock_token": task["lock_token"], "variables": {"charge_id": "ch-h"}})
    assert done.status_code == 200 and done.json()["status"] == "COMPLETED"
    again = await http.post(f"/external-tasks/{task['id']}/failure",
                            json={"lock_token": task["lock_token"], "message": "too late"})
    assert again.status_code == 409 and again.json()["error"] == "not_open"
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).state["receipt"] == "H-1 paid with ch-h"
    listed = await http.get("/external-tasks", params={"status": "completed"})
    assert [t["id"] for t in listed.json()["tasks"]] == [task["id"]]
    unknown = await http.get("/external-tasks", params={"status": "bogus"})  # was 200 with no tasks
    assert (unknown.status_code, unknown.json()["error"]) == (400, "invalid_input"), unknown.text


async def test_failure_and_business_error_over_http(engine: Engine, http: httpx.AsyncClient) -> None:
    iid = await engine.client.start(payment, {"order_id": "H-2", "amount": 9})
    await engine.run_until_idle()
    body = {"worker_id": "curl", "topic": "payments"}
    [task] = (await http.post("/external-tasks/fetch-and-lock", json=body)).json()["tasks"]
    failed = await http.post(f"/external-tasks/{task['id']}/failure",
                             json={"lock_token": task["lock_token"], "message": "busy", "retry_delay": 0})
    assert failed.status_code == 200 and failed.json()["status"] == "OPEN" and failed.json()["retries"] == 2
    [task] = (await http.post("/external-tasks/fetch-and-lock", json=body)).json()["tasks"]
    raised = await http.post(f"/external-tasks/{task['id']}/business-error",
                             json={"lock_token": task["lock_token"], "code": "card_declined"})
    assert raised.status_code == 200 and raised.json()["status"] == "ERROR"
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).state["declined"] is True


async def test_errors_are_json_with_a_status(http: httpx.AsyncClient) -> None:
    unauthorized = await http.post("/external-tasks/fetch-and-lock", json={}, headers={"authorization": "Bearer x"})
    assert unauthorized.status_code == 401 and unauthorized.json()["error"] == "unauthorized"
    assert (await http.get("/health", headers={"authorization": ""})).status_code == 200
    missing = await http.post("/external-tasks/fetch-and-lock", json={"topics": ["payments"]})
    assert missing.status_code == 400 and "worker_id" in missing.json()["message"]
    bad = await http.post("/external-tasks/fetch-and-lock", content=b"{not json")
    assert bad.status_code == 400
    deep = await http.post("/external-tasks/fetch-and-lock", content=b"[" * 100_000 + b"]" * 100_000)
    assert deep.status_code == 400 and deep.json()["error"] == "invalid_input"  # a RecursionError was a 500
    wide = await http.post("/external-tasks/fetch-and-lock", json={"worker_id": "w", "topics": ["x"], "max_tasks": 0})
    assert wide.status_code == 400 and "max_tasks" in wide.json()["message"]
    for topics in (5, True, {"payments": 1}):  # not iterated: a number was a 500, an object's keys passed for topics
        odd = await http.post("/external-tasks/fetch-and-lock", json={"worker_id": "w", "topics": topics})
        assert odd.status_code == 400 and "topics" in odd.json()["message"], topics
    unknown = await http.post("/external-tasks/6b1c8a1e-0000-4000-8000-000000000000/complete",
                              json={"lock_token": "6b1c8a1e-0000-4000-8000-000000000000"})
    assert unknown.status_code == 404
    no_route = await http.get("/nothing")
    assert no_route.status_code == 404 and no_route.json()["error"] == "not_found"  # was the text "Not Found"
    no_task_route = await http.get("/external-tasks/6b1c8a1e-0000-4000-8000-000000000000")
    assert no_task_route.status_code == 404 and no_task_route.json()["error"] == "not_found"
    wrong_method = await http.get("/external-tasks/fetch-and-lock")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"] == "method_not_allowed"
    assert wrong_method.headers["allow"] == "POST"


async def test_a_field_or_parameter_a_route_does_not_take_is_refused_naming_it(
    engine: Engine, http: httpx.AsyncClient
) -> None:
    """A misspelled field was dropped: `lock_duraton: 300` locked the task for the default 30 s (its worker
    then lost it mid-work), `max_task: 10` fetched one task, and `?stauts=OPEN` listed every task."""
    await engine.client.start(payment, {"order_id": "A-1", "amount": 5})
    await engine.run_until_idle()
    fetch = {"worker_id": "w", "topics": ["payments"], "lock_duraton": 300}
    typo = await http.post("/external-tasks/fetch-and-lock", json=fetch)
    assert (typo.status_code, typo.json()) == (400, {
        "error": "invalid_input", "message": "unknown field 'lock_duraton' (this request takes: lock_duration, "
        "max_tasks, timeout, topic, topics, worker_id)"})
    listed = await http.get("/external-tasks", params={"stauts": "OPEN"})
    assert (listed.status_code, listed.json()["message"]) == (
        400, "unknown parameter 'stauts' (this request takes: cursor, instance_id, limit, status, topic)")
    del fetch["lock_duraton"]
    # the refused fetch locked nothing: this one gets the task
    [task] = (await http.post("/external-tasks/fetch-and-lock", json=fetch)).json()["tasks"]
    done = await http.post(f"/external-tasks/{task['id']}/complete",
                           json={"lock_token": task["lock_token"], "varaibles": {"charge_id": "c"}})
    assert (done.status_code, done.json()["message"]) == (
        400, "unknown field 'varaibles' (this request takes: lock_token, variables, worker_id)")


async def test_the_list_pages_oldest_first(engine: Engine, http: httpx.AsyncClient) -> None:
    """GET /external-tasks could not page: the first `limit` (at most 10,000) and no way on. A fork's
    three tasks are made in one commit, at one instant: the cursor keeps their order by id."""
    await engine.client.start(shipping, {})
    await engine.run_until_idle()
    seen: list[str] = []
    cursor: str | None = None
    for _ in range(4):
        got = await http.get("/external-tasks", params={"limit": 1, **({"cursor": cursor} if cursor else {})})
        assert got.status_code == 200, got.text
        seen += [t["id"] for t in got.json()["tasks"]]
        cursor = got.json()["next_cursor"]
        if cursor is None:
            break
    whole = (await http.get("/external-tasks")).json()
    assert len(seen) == 3 and seen == [t["id"] for t in whole["tasks"]] and whole["next_cursor"] is None
    bad = await http.get("/external-tasks", params={"cursor": "bm90IGEgY3Vyc29y"})
    assert (bad.status_code, bad.json()["error"]) == (400, "invalid_input"), bad.text


async def test_a_body_over_the_limit_is_refused_as_it_arrives(engine: Engine, http: httpx.AsyncClient) -> None:
    """The whole body was read into memory before its size was looked at (any size a client sent, with a
    token or on a server without one), and then answered as bad input (400)."""
    declared = await http.post("/external-tasks/fetch-and-lock", content=b" " * (MAX_BODY_BYTES + 1))
    assert declared.status_code == 413 and declared.json()["error"] == "body_too_large"
    chunk, chunks, read = b" " * 65536, 64, 0  # 4 MiB, sent without a Content-Length (chunked)

    async def receive() -> dict[str, object]:
        nonlocal read
        read += 1
        return {"type": "http.request", "body": chunk, "more_body": read < chunks}

    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/external-tasks/fetch-and-lock", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "query_string": b"", "http_version": "1.1",
             "scheme": "http", "server": ("test", 80), "client": ("127.0.0.1", 1)}
    tasks = ExternalTasks(engine.store)
    await create_app(tasks)(scope, receive, send)  # type: ignore[arg-type]
    assert sent[0]["status"] == 413
    assert read <= MAX_BODY_BYTES // len(chunk) + 1, f"read {read} chunks of {chunks}: no more than the limit"
