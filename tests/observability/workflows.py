"""A workflow whose handlers report the durable context and the trace they run in."""

from __future__ import annotations

import contextvars
import logging
from datetime import timedelta
from typing import Any

from opentelemetry import trace
from pydantic import BaseModel

from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow

tenant: contextvars.ContextVar[str] = contextvars.ContextVar("tenant")
user: contextvars.ContextVar[str] = contextvars.ContextVar("user")
auditor: contextvars.ContextVar[str] = contextvars.ContextVar("auditor")

SEEN: dict[str, dict[str, Any]] = {}
"""step -> what its handler saw: tenant, user, auditor, trace id, parent span id."""


class Doc(BaseModel):
    n: int = 0


def _record(step: str) -> None:
    span = trace.get_current_span().get_span_context()
    SEEN[step] = {"tenant": tenant.get(None), "user": user.get(None), "auditor": auditor.get(None),
                  "trace_id": span.trace_id}


traced: Workflow[Doc] = Workflow("traced", version=1, state=Doc)


@traced.step(start=True, next="nap")
async def first(ctx: StepContext, state: Doc) -> None:
    _record("first")


traced.timer("nap", delay=timedelta(minutes=1), next="second")


@traced.step(next="hold")
def second(ctx: StepContext, state: Doc) -> None:  # sync: runs in a worker thread
    _record("second")


traced.wait("hold", signals={"go": "third"})


@traced.step
async def third(ctx: StepContext, state: Doc) -> None:
    _record("third")


registry = Registry(traced)


FLAKY: dict[str, int] = {}
"""instance id -> how many more times `wobbly.work` raises."""

log = logging.getLogger("stepstone.tests.handler")

wobbly: Workflow[Doc] = Workflow("wobbly", version=1, state=Doc)


@wobbly.step(start=True, retry=Retry(max_attempts=2, backoff=0.01))
async def work(ctx: StepContext, state: Doc) -> None:
    log.info("working")
    left = FLAKY.get(ctx.instance_id, 0)
    if left:
        FLAKY[ctx.instance_id] = left - 1
        raise RuntimeError("wobble")


registry.add(wobbly)


emitter: Workflow[Doc] = Workflow("emitter", version=1, state=Doc)


@emitter.step(start=True)
async def announce(ctx: StepContext, state: Doc) -> None:
    ctx.emit("doc.announced", {"n": state.n}, key="k")


registry.add(emitter)


# Branches and a child: each handler reports the tenant it runs with.
fanned: Workflow[Doc] = Workflow("fanned", version=1, state=Doc)
fanned.fork("split", branches={"left": "left", "right": "right"}, start=True)


@fanned.step(next="together")
async def left(ctx: StepContext, state: Doc) -> None:
    _record("left")


@fanned.step(next="together")
def right(ctx: StepContext, state: Doc) -> None:
    _record("right")


fanned.join("together", fork="split", next="spawn")


@fanned.child(workflow="kid", next="after_child")
def spawn(ctx: StepContext, state: Doc) -> Doc:
    return Doc()


@fanned.step
async def after_child(ctx: StepContext, state: Doc) -> None:
    _record("after_child")


kid: Workflow[Doc] = Workflow("kid", version=1, state=Doc)


@kid.step(start=True)
async def kid_work(ctx: StepContext, state: Doc) -> None:
    _record("kid_work")


registry.add(fanned)
registry.add(kid)
