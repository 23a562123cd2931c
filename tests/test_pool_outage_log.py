"""An outage is said once by asyncpg's pool: it warned that it failed to restore its connection floor
every second or two for as long as the database was down (tests/chaos/test_driver_logs.py has the
restart; here the driver's warnings are sent as it sends them, and a real pool connects again)."""

from __future__ import annotations

import logging

import pytest

from stepstone.store.database import create_pool, install_one_line_driver_logs

DRIVER_LINE = "Failed to restore the pool connection floor; retrying"


def _driver_fails() -> None:
    """The warning as asyncpg logs it, with the exception it met."""
    exc = ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)")
    logging.getLogger("asyncpg.pool").warning(DRIVER_LINE, exc_info=(type(exc), exc, None))


async def test_the_floor_failures_of_an_outage_are_one_warning_until_a_pool_connects(
        database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    install_one_line_driver_logs()
    caplog.set_level(logging.INFO)
    for _ in range(5):
        _driver_fails()
    said = [r for r in caplog.records if DRIVER_LINE in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert said[0].getMessage().endswith("(said once: quiet until the pool connects again)")
    assert "ConnectionRefusedError" in said[0].getMessage() and said[0].exc_info is None
    caplog.clear()
    pool = await create_pool(database_url, min_size=1, max_size=1)  # its connection ends the outage
    await pool.close()
    [back] = [r.getMessage() for r in caplog.records if r.name == "stepstone.store"]
    assert back.startswith("database connections work again after 5 failed attempt(s)"), back
    caplog.clear()
    _driver_fails()  # a later outage is said again
    assert len([r for r in caplog.records if DRIVER_LINE in r.getMessage()]) == 1
    pool = await create_pool(database_url, min_size=1, max_size=1)
    await pool.close()
