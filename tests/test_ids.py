"""Instance ids are UUIDv7: time-ordered, so new instances land on the right edge of every index."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import pytest

from stepstone import ids
from stepstone.ids import new_instance_id, short_id


def test_an_id_is_a_version_7_uuid_carrying_its_creation_millisecond() -> None:
    before = time.time_ns() // 1_000_000
    value = uuid.UUID(new_instance_id())
    after = time.time_ns() // 1_000_000
    assert (value.version, value.variant) == (7, uuid.RFC_4122)
    assert before <= value.int >> 80 <= after


def test_ids_sort_by_creation_time_and_do_not_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [time.time_ns()]
    monkeypatch.setattr(ids, "time", SimpleNamespace(time_ns=lambda: now[0]))
    first = [new_instance_id() for _ in range(5_000)]  # all in one millisecond of the stopped clock
    now[0] += 1_000_000  # the next millisecond
    later = [new_instance_id() for _ in range(5_000)]
    assert len(set(first + later)) == 10_000
    assert max(first) < min(later)  # the text form sorts as the uuid does (fixed-width lowercase hex)


def test_the_short_form_tells_apart_instances_started_together() -> None:
    ids = [new_instance_id() for _ in range(1_000)]
    assert len({i[:8] for i in ids}) <= 2  # the start time, one value per 65.5 s: not the short form
    assert len({short_id(i) for i in ids}) == 1_000
