"""Rich tables and progress bars for the operator commands (plain text when not on a terminal)."""

from __future__ import annotations

import io
import shutil
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

    table = Table(*headers, title=title, box=SIMPLE_HEAD if header else None, title_justify="left",
                  pad_edge=False, show_header=header)
    for row in rows:
        table.add_row(*("" if cell is None else str(cell) for cell in row))
    out = io.StringIO()
    width = max(shutil.get_terminal_size((160, 24)).columns, 120)
    Console(file=out, width=width, color_system=None, force_terminal=False, soft_wrap=False).print(table)
    return out.getvalue().rstrip("\n")


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
