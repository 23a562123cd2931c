"""The movable clock returns the new time; the error tree lets a caller tell every kind of failure apart."""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest

from stepstone import errors
from stepstone.core.limits import Limits, PayloadRejected
from stepstone.examples import orders
from stepstone.store.database import connect
from stepstone.store.postgres import PostgresStore
from stepstone.testing import open_engine

# What a caller can do about an error, told by its type alone.
CATEGORIES: dict[str, type[errors.StepstoneError]] = {
    "configuration": errors.ConfigError,
    "transient": errors.Unavailable,
    "not found": errors.NotFound,
    "conflict": errors.Conflict,
    "refusal": errors.InvalidInput,
    "timeout": errors.WaitTimeout,
    "closed": errors.ClientClosed,
    "bug": errors.InternalError,
}
GROUPS = {errors.StepstoneError, errors.DatabaseError}  # group by where, not by what to do


def near(delta: timedelta, expected: timedelta) -> bool:
    """Equal but for the real time the statements took (well under a minute)."""
    return abs(delta - expected) < timedelta(minutes=1)


async def test_move_clock_returns_the_new_database_time(database_url: str) -> None:
    store = await PostgresStore.open(database_url)
    try:
        before = await store.db_now()
        moved = await store.move_clock(3600)
        after = await store.db_now()
        assert near(moved - before, timedelta(hours=1))
        assert near(after - moved, timedelta(0))
        back = await store.move_clock(-7200)
        assert near(moved - back, timedelta(hours=2))
    finally:
        await store.close()


async def test_engine_move_clock_returns_the_new_database_time(database_url: str) -> None:
    async with open_engine(database_url, orders.registry) as engine:
        before = await engine.store.db_now()
        moved = await engine.move_clock(timedelta(days=1))
        assert near(moved - before, timedelta(days=1))
        assert near(await engine.store.db_now() - moved, timedelta(0))


def _classes() -> list[type[errors.StepstoneError]]:
    return [getattr(errors, name) for name in errors.__all__]


@pytest.mark.parametrize("cls", _classes(), ids=lambda c: c.__name__)
def test_every_error_falls_in_exactly_one_category(cls: type[errors.StepstoneError]) -> None:
    if cls in GROUPS:
        return
    found = [name for name, base in CATEGORIES.items() if issubclass(cls, base)]
    assert len(found) == 1, f"{cls.__name__} is in {found or 'no category'}"


def test_the_categories_are_disjoint_and_drawn_in_the_docstring() -> None:
    doc = inspect.getdoc(errors) or ""
    for cls in _classes():
        assert cls.__name__ in doc, f"{cls.__name__} is missing from the tree in errors.py"
    for a in CATEGORIES.values():
        for b in CATEGORIES.values():
            assert a is b or not (issubclass(a, b) or issubclass(b, a)), (a, b)


def test_schema_and_privilege_errors_are_configuration_and_database_errors() -> None:
    for cls in (errors.SchemaNotReady, errors.SchemaTooNew, errors.InsufficientPrivilege):
        assert issubclass(cls, errors.ConfigError)
        assert issubclass(cls, errors.DatabaseError)
    assert not issubclass(errors.InvalidDatabaseUrl, errors.DatabaseUnavailable)


@pytest.mark.parametrize(("value", "cls", "reason"), [
    ("x" * 300_000, errors.PayloadTooLarge, "too_large"),
    ([[[[[1]]]]], errors.PayloadTooDeep, "too_deep"),
])
def test_payload_errors_keep_what_and_reason(value: object, cls: type[errors.InvalidInput], reason: str) -> None:
    limits = Limits(max_depth=3)
    with pytest.raises(PayloadRejected) as caught:
        limits.encode("signal payload", value)
    typed = errors.refused(caught.value)
    assert type(typed) is cls
    assert typed.what == "signal payload"
    assert getattr(typed, "reason", None) == reason


async def test_a_store_function_without_a_row_is_a_bug(database_url: str) -> None:
    store = await PostgresStore.open(database_url)
    try:
        with pytest.raises(errors.InternalError, match="returned no row"):
            await store._one("instance_status", __import__("uuid").uuid4())
    finally:
        await store.close()


@pytest.mark.parametrize("url", ["not a url", "postgresql://bob:pw@h:port/db", "postgresql://bob:p@w@h/db",
                                 "postgresql://postgres@127.0.0.1:5432/postgres?no_such_setting=1"])
async def test_a_malformed_url_is_a_configuration_error_not_a_transient_one(url: str) -> None:
    with pytest.raises(errors.InvalidDatabaseUrl) as caught:
        await connect(url, timeout=5)
    assert not isinstance(caught.value, errors.DatabaseUnavailable)
    assert "malformed database URL" in str(caught.value)
    assert "pw" not in caught.value.url and "p@w" not in str(caught.value)


async def test_an_unreachable_server_is_transient() -> None:
    with pytest.raises(errors.DatabaseUnavailable) as caught:
        await connect("postgresql://bob@127.0.0.1:1/db", timeout=5)
    assert (caught.value.host, caught.value.port) == ("127.0.0.1", 1)
