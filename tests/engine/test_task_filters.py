"""Follow-up dates and saved inbox filters against real PostgreSQL: a task's follow-up date comes from
the state (seconds from opening, or an instant), the inbox hides tasks put aside until later (by an
instant, or by the database's now, which the test clock moves), and a user's named filters are
durable rows per user and scope that list, apply and delete."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from stepstone.client_tasks import TaskFilter
from stepstone.errors import InvalidInput, TaskFilterNotFound
from stepstone.testing import Engine, open_engine
from tests.engine.task_workflows import Expense, callback, expense, registry

LATER = "2100-01-01T09:00:00+00:00"


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, registry, concurrency=2) as e:
        yield e


async def _callbacks(engine: Engine) -> dict[str, str]:
    """Three call-backs: now (no follow-up), in an hour (seconds), at an instant far ahead; title -> task id."""
    for customer, call_at in (("ann", None), ("ben", 3600), ("cy", LATER)):
        await engine.client.start(callback, {"customer": customer, "call_at": call_at})
    await engine.run_until_idle()
    page = await engine.client.tasks(user="dee", groups=["desk"])
    return {t.title: t.id for t in page.tasks}


def _titles(page: object) -> set[str]:
    return {t.title for t in page.tasks}  # type: ignore[attr-defined]


async def test_the_follow_up_date_comes_from_the_state(engine: Engine) -> None:
    opened = await _callbacks(engine)
    now = await engine.store.db_now()
    ann, ben, cy = [await engine.client.task(opened[f"Call {c} back"]) for c in ("ann", "ben", "cy")]
    assert ann.follow_up_at is None
    assert ben.follow_up_at is not None and abs((ben.follow_up_at - now) - timedelta(hours=1)) < timedelta(minutes=1)
    assert cy.follow_up_at == datetime.fromisoformat(LATER)


async def test_the_inbox_hides_tasks_put_aside_until_later(engine: Engine) -> None:
    await _callbacks(engine)
    everything = await engine.client.tasks(user="dee", groups=["desk"])
    assert _titles(everything) == {"Call ann back", "Call ben back", "Call cy back"}
    today = TaskFilter(hide_later_follow_ups=True)
    assert _titles(await engine.client.tasks(user="dee", groups=["desk"], where=today)) == {"Call ann back"}
    await engine.move_clock(timedelta(hours=2))  # ben's follow-up date has come: back in the inbox
    assert _titles(await engine.client.tasks(user="dee", groups=["desk"], where=today)) == \
        {"Call ann back", "Call ben back"}
    assert await engine.client.count_tasks(user="dee", groups=["desk"], where=today) == 2
    before = TaskFilter(follow_up_before=datetime(2100, 1, 1, 9, tzinfo=UTC))  # at or before: cy included
    assert await engine.client.count_tasks(user="dee", groups=["desk"], where=before) == 3
    earlier = TaskFilter(follow_up_before=datetime(2099, 12, 31, tzinfo=UTC))
    assert _titles(await engine.client.tasks(user="dee", groups=["desk"], where=earlier)) == \
        {"Call ann back", "Call ben back"}


async def test_a_saved_filter_is_listed_used_replaced_and_deleted(engine: Engine) -> None:
    await _callbacks(engine)
    await engine.client.start(expense, Expense(expense_id="x-1", employee="eve", amount=3))
    await engine.run_until_idle()
    client = engine.client
    saved = await client.save_task_filter("today", user="dee", where=TaskFilter(hide_later_follow_ups=True,
                                                                                 workflow="callback"))
    assert (saved.user, saved.scope, saved.mode) == ("dee", "default", "inbox")
    await client.save_task_filter("all-finance", user="dee", mode="all", where=TaskFilter(candidate_group="finance"))
    await client.save_task_filter("today", user="eli", where=TaskFilter(text="nothing like this"))  # eli's own
    assert [f.name for f in await client.task_filters(user="dee")] == ["all-finance", "today"]
    assert [f.name for f in await client.task_filters(user="dee", scope="acme")] == []  # another scope

    page = await client.tasks(user="dee", groups=["desk", "finance"], saved_filter="today")
    assert _titles(page) == {"Call ann back"}  # the expense (no follow-up) is not a callback: filtered out
    assert await client.count_tasks(user="dee", groups=["desk"], saved_filter="today") == 1
    assert _titles(await client.tasks(user="dee", saved_filter="all-finance")) == {"Approve expense x-1 of eve"}
    assert await client.count_tasks(user="eli", groups=["desk"], saved_filter="today") == 0

    replaced = await client.save_task_filter("today", user="dee", where=TaskFilter(text="ben"))
    assert replaced.created_at == saved.created_at and replaced.where == TaskFilter(text="ben", scope="default")
    assert _titles(await client.tasks(user="dee", groups=["desk"], saved_filter="today")) == {"Call ben back"}

    assert await client.delete_task_filter("today", user="dee") is True
    assert await client.delete_task_filter("today", user="dee") is False
    with pytest.raises(TaskFilterNotFound):
        await client.tasks(user="dee", groups=["desk"], saved_filter="today")
    assert [f.name for f in await client.task_filters(user="eli")] == ["today"]  # someone else's stays


async def test_a_saved_filter_shows_only_its_own_scope(engine: Engine) -> None:
    await _callbacks(engine)  # every task here is in the default scope
    await engine.client.save_task_filter("desk", user="dee", scope="acme")
    assert (await engine.client.tasks(user="dee", groups=["desk"], saved_filter="desk", scope="acme")).tasks == []
    await engine.client.save_task_filter("desk", user="dee")
    assert len((await engine.client.tasks(user="dee", groups=["desk"], saved_filter="desk")).tasks) == 3


async def test_saved_filters_refuse_bad_input(engine: Engine) -> None:
    client = engine.client
    for bad in (client.save_task_filter("", user="dee"),
                client.save_task_filter("x", user="dee", mode="mine"),
                client.save_task_filter("x", user="dee", where=TaskFilter(scope="acme")),
                client.save_task_filter("x", user="dee", where=TaskFilter(due_before=datetime(2030, 1, 1))),  # noqa: DTZ001 - the naive instant is the point
                client.tasks(user="dee", saved_filter="x", where=TaskFilter(text="y")),
                client.tasks(user="dee", saved_filter="x", mode="all"),
                client.tasks(saved_filter="x", mode=None),
                client.tasks(user="dee", scope="acme")):
        with pytest.raises(InvalidInput):
            await bad
    assert await client.task_filters(user="dee") == ()
