"""Rich tables and progress bars for the operator commands (plain text when not on a terminal)."""

from __future__ import annotations

import io
import shutil
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["progress_bar", "rich_table"]


def rich_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None, header: bool = True
) -> str:
    """The rows as a rich table, rendered to text (no colour codes: it is piped as often as shown)."""
    from rich.box import SIMPLE_HEAD  # noqa: PLC0415 - rich loads only for the commands that print with it
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    cells = [["" if cell is None else str(cell) for cell in row] for row in rows]
    table = Table(title=title, box=SIMPLE_HEAD if header else None, title_justify="left", pad_edge=False,
                  show_header=header)
    for n, name in enumerate(headers):
        # A column is never narrower than its longest word: an instance id cut to "2221e445-e69…" cannot
        # be copied into the next command. Columns wrap between words instead.
        table.add_column(name, min_width=max((len(word) for row in cells if n < len(row)
                                              for word in row[n].split()), default=0))
    for row in cells:
        table.add_row(*row)
    out = io.StringIO()
    console = Console(file=out, width=_UNBOUNDED, color_system=None, force_terminal=False, soft_wrap=False)
    fits = console.measure(table)
    # Piped, a table is as wide as its rows (a script reads whole lines); on a terminal, as wide as the
    # terminal, or wider when its words do not fit (the terminal then wraps the lines, cutting nothing).
    width = max(shutil.get_terminal_size().columns, fits.minimum) if sys.stdout.isatty() else fits.maximum
    console.width = max(width, 1)
    console.print(table)
    return out.getvalue().rstrip("\n")


_UNBOUNDED = 100_000
"""The width a table is measured at: wider than any row it holds."""


@contextmanager
def progress_bar(description: str, total: int | None, *, enabled: bool = True) -> Iterator[Any]:
    """A progress bar on stderr; yields `advance(done)` to report how far it got."""
    from rich.console import Console  # noqa: PLC0415 - rich loads only when a bar may be shown
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield lambda _done: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda done: bar.update(task, completed=done)
