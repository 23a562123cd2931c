"""A lifespan for FastAPI and Starlette apps: a `Client` for the app's lifetime, optionally with a worker
running in the same process.

    from fastapi import Depends, FastAPI, Request
    from stepstone.integrations.asgi import lifespan, stepstone_client

    app = FastAPI(lifespan=lifespan(registry, worker=True))

    @app.post("/orders")
    async def place(order: dict, client = Depends(stepstone_client)):
        return {"instance_id": await client.start("order", order)}

The client is in the lifespan state (`request.state.stepstone`) and on `app.state.stepstone`. With
`worker=True` the app also runs the registry's workflows (an in-process worker, drained on shutdown:
in-flight steps finish up to `drain_timeout`, the rest are released for other workers); without it,
run `stepstone worker` beside the app. `problem_responses(app)` answers the stepstone errors a route
lets through (bad input, an unknown instance, a business key in use) as stepstone's HTTP API does,
not as 500s.
"""

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from stepstone.authoring.workflow import Registry
from stepstone.client import Client
from stepstone.errors import StepstoneError
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.factory import open_ready_store

try:  # FastAPI injects the request by this annotation (resolved at run time: no postponed annotations here)
    from starlette.requests import HTTPConnection
except ImportError:  # without starlette there is nothing to inject into
    HTTPConnection = Any  # type: ignore[misc,assignment]

__all__ = ["lifespan", "problem_responses", "stepstone_client"]


def lifespan(
    registry: Registry | None = None, *, database_url: str | None = None, schema: str | None = None,
    worker: bool = False, **worker_config: Any,
) -> "Callable[[Any], AbstractAsyncContextManager[dict[str, Any]]]":
    """The app's lifespan: connect on startup (the schema must be migrated, except the embedded default),
    close on shutdown. `worker_config` goes to `WorkerConfig` (concurrency, lease_seconds, ...)."""
    if worker and registry is None:
        raise ValueError("lifespan(worker=True) needs the registry whose workflows the worker runs")
    config = WorkerConfig(**worker_config)

    @asynccontextmanager
    async def run(app: Any) -> AsyncIterator[dict[str, Any]]:
        store = await open_ready_store(database_url, schema, max_size=(config.concurrency + 4) if worker else 10)
        client = Client(store, registry)
        running: Worker | None = None
        try:
            if worker:
                assert registry is not None
                running = Worker(store, registry, config)
                await running.start()
            state = getattr(app, "state", None)
            if state is not None:
                state.stepstone = client
                state.stepstone_worker = running
            yield {"stepstone": client, "stepstone_worker": running}
        finally:
            if running is not None:
                await running.stop()
            await client.close()

    return run


def stepstone_client(request: HTTPConnection) -> Client:
    """The app's client, for `Depends(stepstone_client)` (or call it with the request)."""
    client = getattr(request.state, "stepstone", None)
    if not isinstance(client, Client):
        raise TypeError("no stepstone client on this app: pass lifespan=stepstone.integrations.asgi.lifespan(...)")
    return client


def problem_responses(app: Any) -> None:
    """Answer a stepstone error that a route of `app` lets through as stepstone's HTTP API answers it: its
    status (InvalidInput 422, NotFound 404, Conflict 409, Unavailable 503, ...; docs/api.md, "Errors") and
    a problem+json body naming the error and its fields, instead of a 500 and a traceback in the log.
    Other exceptions are left to the app. Needs FastAPI (`pip install 'stepstone[api]'`)."""
    try:
        from stepstone.api.problems import stepstone_error_response  # noqa: PLC0415 - FastAPI is optional
    except ImportError as exc:
        raise ImportError(f"problem_responses needs FastAPI (pip install 'stepstone[api]'): {exc}") from None
    app.add_exception_handler(StepstoneError, stepstone_error_response)
