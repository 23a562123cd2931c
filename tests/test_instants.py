"""Instants outside what the driver holds (years 1 to 9999 in UTC) are refused as input wherever a caller
hands one in: filters of operations and inboxes, and page cursors (the API's are tested in
tests/api/test_api_bulk.py)."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from stepstone import instants
from stepstone.cli.common import CliError
from stepstone.cli.instance_args import decode_cursor
from stepstone.errors import InvalidInput
from stepstone.ops import InstanceFilter
from stepstone.store.task_port import TaskFilter

YEAR_ZERO = datetime(1, 1, 1, tzinfo=timezone(timedelta(minutes=1)))  # year 0 in UTC
YEAR_10000 = datetime(9999, 12, 31, 23, 59, tzinfo=timezone(-timedelta(minutes=2)))


def test_an_offset_that_moves_an_instant_out_of_range_is_not_storable() -> None:
    assert not instants.storable(YEAR_ZERO)
    assert not instants.storable(YEAR_10000)
    assert instants.storable(datetime(1, 1, 1, tzinfo=UTC))
    assert instants.storable(datetime(9999, 12, 31, 23, 59, tzinfo=UTC))
    assert instants.parse("2026-12-05T10:00:00+02:00") == datetime(2026, 12, 5, 8, tzinfo=UTC)
    with pytest.raises(ValueError, match="outside"):
        instants.parse(YEAR_ZERO.isoformat())


def test_filters_refuse_such_instants_naming_the_field() -> None:
    with pytest.raises(InvalidInput, match="updated since 0001-01-01") as caught:
        InstanceFilter(updated_since=YEAR_ZERO)
    assert caught.value.what == "updated since"
    with pytest.raises(InvalidInput, match="due before 9999-12-31"):
        TaskFilter(due_before=YEAR_10000)
    assert InstanceFilter(since=datetime(1, 1, 1, tzinfo=UTC)).since == datetime(1, 1, 1, tzinfo=UTC)


def test_a_cli_cursor_with_such_an_instant_is_not_a_cursor() -> None:
    raw = json.dumps([YEAR_ZERO.isoformat(), "01a2487d-3832-7cbe-85de-dbd5e9a8bacc"]).encode()
    with pytest.raises(CliError, match="is not a cursor printed by"):
        decode_cursor(base64.urlsafe_b64encode(raw).decode())


def test_a_cli_cursor_without_a_timezone_is_not_a_cursor() -> None:
    """The API's instance list refuses a naive instant in a cursor; the CLI's (the same keys) does too."""
    raw = json.dumps(["2026-12-06T06:34:49", "01a2487d-3832-7cbe-85de-dbd5e9a8bacc"]).encode()
    with pytest.raises(CliError, match="is not a cursor printed by"):
        decode_cursor(base64.urlsafe_b64encode(raw).decode())
