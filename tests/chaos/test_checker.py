"""The chaos checker's own rules, on hand-made ledgers: an explanation must be able to fail."""

from __future__ import annotations

from tests.chaos.rig.checker import explain

KEY = "00000000-0000-0000-0000-000000000001/s1/1"


def _explain(rows: list[tuple[int, float, int]], kills: dict[int, float]) -> list[str]:
    return explain(KEY, rows, retried=set(), kill_at=kills, fenced_on={}, paused={})


def test_a_kill_between_the_effect_and_its_rerun_explains_the_duplicate() -> None:
    rows = [(1, 100.0, 1), (2, 103.0, 1)]  # pid 1 did it, was killed at 100.2, pid 2 re-ran it at 103
    assert _explain(rows, {1: 100.2}) == ["killed", ""]


def test_a_kill_long_after_the_rerun_explains_nothing() -> None:
    rows = [(1, 100.0, 1), (2, 103.0, 1)]
    assert _explain(rows, {1: 130.0}) == ["", ""]  # pid 1 committed nothing 30 s later; a real duplicate


def test_a_kill_before_the_effect_explains_nothing() -> None:
    rows = [(1, 100.0, 1), (2, 103.0, 1)]
    assert _explain(rows, {1: 90.0}) == ["", ""]


def test_the_last_effect_is_never_explained_by_a_kill() -> None:
    rows = [(1, 100.0, 1), (2, 103.0, 1)]
    assert _explain(rows, {1: 100.2, 2: 103.1}) == ["killed", ""]  # pid 2's effect is the one committed
