"""The operator commands' tables never cut a word: an instance id must survive the trip from a table
into the next command, piped or on a narrow terminal, whatever COLUMNS says."""

from __future__ import annotations

import os
import sys

import pytest

from stepstone.cli.rich_output import rich_table

ID = "f9d53710-f20e-4799-bbdd-88e6a9bdefab"
HEADERS = ["id", "workflow", "version", "status", "step", "business key", "created", "updated", "waiting for"]
ROW = [ID, "hello_world_flow", 1, "COMPLETED", "done", None, "2026-12-05 10:54:19.123456+00:00",
       "2026-12-05 10:54:19.123456+00:00", "signal approve"]


def test_piped_tables_are_as_wide_as_their_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # what an 80-column shell (and pytest-xdist's workers) export
    lines = rich_table(HEADERS, [ROW]).splitlines()
    row = next(line for line in lines if ID in line)
    assert row.split()[:2] == [ID, "hello_world_flow"]
    assert "2026-12-05 10:54:19.123456+00:00" in row and row.rstrip().endswith("signal approve")


def test_a_narrow_terminal_wraps_between_words_and_cuts_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr("shutil.get_terminal_size", lambda *_: os.terminal_size((80, 24)))
    text = rich_table(HEADERS, [ROW])
    assert "…" not in text
    words = text.split()
    assert ID in words and "hello_world_flow" in words and "10:54:19.123456+00:00" in words
    assert max(len(line) for line in text.splitlines()) > 80  # wider than the terminal, which wraps it


def test_a_wide_terminal_keeps_each_row_on_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr("shutil.get_terminal_size", lambda *_: os.terminal_size((250, 24)))
    row = next(line for line in rich_table(HEADERS, [ROW]).splitlines() if ID in line)
    assert "2026-12-05 10:54:19.123456+00:00" in row
