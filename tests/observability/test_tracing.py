"""One trace follows an instance: the steps of a start are children of its span, on any worker and after
a timer; the step a signal leads to is in the signal's trace; registered values are bound again around
each handler from what the store kept, and an identity only when declared safe."""

from __future__ import annotations

from datetime import timedelta

from opentelemetry import trace

from stepstone import context as durable_context
from stepstone.testing import Engine
from tests.observability import workflows
from tests.observability.workflows import auditor, tenant, traced, user


def _by_name(spans: object) -> dict[str, list[object]]:
    out: dict[str, list[object]] = {}
    for s in spans.get_finished_spans():  # type: ignore[attr-defined]
        out.setdefault(s.name, []).append(s)
    return out


async def test_one_trace_follows_an_instance_across_workers_timers_and_signals(engine: Engine, spans: object) -> None:
    tracer = trace.get_tracer("the-app")
    durable_context.register(tenant)
    durable_context.register(user, identity=True)
    durable_context.register(auditor, identity=True, safe=True)
    try:
        tokens = [tenant.set("acme"), user.set("bob"), auditor.set("eve")]
        with tracer.start_as_current_span("checkout") as checkout:
            iid = await engine.client.start(traced, {})
        for var, token in zip((tenant, user, auditor), tokens, strict=True):
            var.reset(token)  # nothing is left in this task's context: what handlers see came from the store
        start_trace = checkout.get_span_context().trace_id

        await engine.run_until_idle()
        other = engine.new_worker()  # the timer's step runs on another worker
        await engine.move_clock(timedelta(minutes=2))
        await other.run_until_idle()

        token = tenant.set("globex")
        with tracer.start_as_current_span("payment webhook") as webhook:
            await engine.client.signal(iid, "go")
        tenant.reset(token)
        await engine.new_worker().run_until_idle()
    finally:
        for name in ("tenant", "user", "auditor"):
            durable_context.durable.unregister(name)

    seen = workflows.SEEN
    assert seen["first"] == {"tenant": "acme", "user": None, "auditor": "eve", "trace_id": start_trace}
    assert seen["second"] == {"tenant": "acme", "user": None, "auditor": "eve", "trace_id": start_trace}
    assert seen["third"] == {"tenant": "globex", "user": None, "auditor": None,
                             "trace_id": webhook.get_span_context().trace_id}

    by_name = _by_name(spans)
    [start] = by_name["stepstone.start traced"]
    assert start.parent.span_id == checkout.get_span_context().span_id
    assert start.attributes["stepstone.instance_id"] == iid
    [first] = by_name["stepstone.step traced.first"]
    assert first.parent.span_id == start.context.span_id
    assert {k: first.attributes[k] for k in ("stepstone.workflow", "stepstone.version", "stepstone.step",
                                               "stepstone.position", "stepstone.attempt", "stepstone.instance_id")} \
        == {"stepstone.workflow": "traced", "stepstone.version": 1, "stepstone.step": "first",
            "stepstone.position": "", "stepstone.attempt": 1, "stepstone.instance_id": iid}
    [second] = by_name["stepstone.step traced.second"]
    assert second.context.trace_id == start_trace and second.parent.span_id == start.context.span_id
    [signal] = by_name["stepstone.signal go"]
    [third] = by_name["stepstone.step traced.third"]
    assert third.parent.span_id == signal.context.span_id
    commits = by_name["stepstone.commit"]
    assert {c.context.trace_id for c in commits} == {start_trace, webhook.get_span_context().trace_id}
    assert all(c.attributes["stepstone.outcome"] == "ok" for c in commits)


async def test_the_context_is_kept_with_the_instance_and_the_signal(
    engine: Engine, spans: object, database_url: str,
) -> None:
    import asyncpg  # noqa: PLC0415

    durable_context.register(tenant)
    try:
        token = tenant.set("acme")
        iid = await engine.client.start(traced, {})
        tenant.reset(token)
        await engine.run_until_idle()
        await engine.move_clock(timedelta(minutes=2))
        await engine.client.signal(iid, "go")  # nothing bound: the signal keeps only its trace
    finally:
        durable_context.durable.unregister("tenant")
    conn = await asyncpg.connect(database_url)
    try:
        kept = await conn.fetchval("SELECT context::text FROM stepstone.instances WHERE id = $1::uuid", iid)
        signal = await conn.fetchval("SELECT context::text FROM stepstone.commands WHERE kind = 'SIGNAL'")
    finally:
        await conn.close()
    assert '"vars": {"tenant": "acme"}' in kept and '"traceparent"' in kept
    assert '"vars"' not in signal and '"traceparent"' in signal


async def test_a_failing_step_marks_its_span(engine: Engine, spans: object) -> None:
    from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow  # noqa: PLC0415
    from stepstone.runtime.worker import Worker  # noqa: PLC0415

    boom: Workflow[workflows.Doc] = Workflow("boom", state=workflows.Doc)

    @boom.step(start=True, retry=Retry(max_attempts=1))
    async def explode(ctx: StepContext, state: workflows.Doc) -> None:
        raise ValueError("no")

    worker = Worker(engine.store, Registry(boom))
    await worker.register()
    await engine.client.start(boom, {})
    await worker.run_until_idle()
    [span] = _by_name(spans)["stepstone.step boom.explode"]
    assert span.status.status_code.name == "ERROR" and span.attributes["stepstone.error_type"] == "ValueError"


async def test_a_failing_steps_span_carries_its_message_as_history_stores_it(engine: Engine, spans: object) -> None:
    """The span's status took the handler's message as raised, a sensitive value of the state in it, where
    history, the instance's error and the log store it redacted."""
    from typing import Annotated  # noqa: PLC0415

    from pydantic import BaseModel  # noqa: PLC0415

    from stepstone.authoring.sensitive import Sensitive  # noqa: PLC0415
    from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow  # noqa: PLC0415
    from stepstone.runtime.worker import Worker  # noqa: PLC0415

    class Card(BaseModel):
        card: Annotated[str, Sensitive] = "4111-1111-1111-1111"

    declined: Workflow[Card] = Workflow("span_declined", state=Card)

    @declined.step(start=True, retry=Retry(max_attempts=1))
    async def charge(ctx: StepContext, state: Card) -> None:
        raise ValueError(f"card {state.card} was declined")

    worker = Worker(engine.store, Registry(declined))
    await worker.register()
    instance_id = await engine.client.start(declined, {})
    await worker.run_until_idle()
    [span] = _by_name(spans)["stepstone.step span_declined.charge"]
    stored = (await engine.client.get(instance_id)).error
    assert stored is not None and "4111" not in stored["message"]
    assert span.status.description == f"ValueError: {stored['message']}"


async def test_an_outbox_event_carries_the_trace_into_the_broker(engine: Engine, spans: object) -> None:
    from stepstone.outbox.publisher import InMemoryBroker, memory_publisher  # noqa: PLC0415
    from stepstone.outbox.relay import Relay  # noqa: PLC0415
    from stepstone.store.outbox import PostgresOutbox  # noqa: PLC0415
    from tests.observability.workflows import emitter  # noqa: PLC0415
    from tests.outbox.conftest import publish_until  # noqa: PLC0415

    with trace.get_tracer("the-app").start_as_current_span("order placed") as placed:
        await engine.client.start(emitter, {})
    await engine.run_until_idle()
    relay = Relay(PostgresOutbox(engine.store), memory_publisher("memory://traced"))
    try:
        assert await publish_until(relay, 1) == 1
        [message] = InMemoryBroker.named("traced").messages
    finally:
        InMemoryBroker.forget("traced")
    trace_id = f"{placed.get_span_context().trace_id:032x}"
    assert message.headers["traceparent"].split("-")[1] == trace_id
    [publish] = _by_name(spans)["stepstone.publish doc.announced"]
    assert publish.context.trace_id == placed.get_span_context().trace_id
    assert publish.attributes["stepstone.outcome"] == "ok"


async def test_branches_and_children_run_in_the_starts_context(engine: Engine, spans: object) -> None:
    from tests.observability.workflows import fanned  # noqa: PLC0415

    durable_context.register(tenant)
    durable_context.register(user, identity=True)  # recorded with the start, never bound into a handler
    try:
        tokens = [tenant.set("acme"), user.set("bob")]
        with trace.get_tracer("the-app").start_as_current_span("fan out") as root:
            iid = await engine.client.start(fanned, {})
        for var, token in zip((tenant, user), tokens, strict=True):
            var.reset(token)
        await engine.run_until_idle()
    finally:
        for name in ("tenant", "user"):
            durable_context.durable.unregister(name)
    trace_id = root.get_span_context().trace_id
    for step in ("left", "right", "kid_work", "after_child"):
        assert workflows.SEEN[step]["tenant"] == "acme", step
        assert workflows.SEEN[step]["user"] is None, step  # not in a branch, not in a child
        assert workflows.SEEN[step]["trace_id"] == trace_id, step
    kept = await engine.store.pool.fetchval(  # type: ignore[attr-defined]
        "SELECT context FROM stepstone.instances WHERE id = $1::uuid", iid)
    assert durable_context.recorded(kept) == {"tenant": "acme", "user": "bob"}  # kept for audit
