"""Where a handler failed: the frames of its error, as stored with the failure and shown to operators.

A failure (`{"step", "type", "message", "attempt"}` in history and in the instance's error) gains
`frames` when its handler raised: the innermost frames below the engine's call of the handler, each
`{"file", "line", "function", "source"}` (the source line's text as Python prints it: code, never a
value; no local variables), outermost first, and `frames_omitted`, how many outer frames were left out
to stay within `MAX_FRAMES` and `MAX_FRAMES_BYTES`. Failures written by earlier releases, and failures
no handler raised (a state that cannot be stored, a wrong transition), have neither key.

An error raised from another (`raise X from Y`), or while handling one, keeps that one as `cause`:
`{"type", "message"}`, its own `frames`/`frames_omitted` (from what remains of the same caps once the
error raised took its frames: the chain together keeps at most `MAX_FRAMES` frames in `MAX_FRAMES_BYTES`),
`"context": true` when it was not named by `from` but being handled, and its own `cause`, at most
`MAX_CAUSES` deep. `raise X from None` keeps none, as Python prints none.

A compensation handler's failure has the same keys; it sits one level down, in the `error` of a
COMPENSATION_ATTEMPT_FAILED entry and of a COMPENSATION_FAILED instance, and in the `last_error` of the
COMPENSATION_FAILED entry and alert. `without_frames` and `traceback_text` look there too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_CAUSES", "MAX_FRAMES", "MAX_FRAMES_BYTES", "Frame", "bounded", "frames_bytes", "frames_document",
           "traceback_text", "without_frames"]

MAX_FRAMES = 20
"""The innermost frames kept of a handler's error (a deep recursion keeps its last 20)."""
MAX_FRAMES_BYTES = 8192
"""The most the kept frames take as JSON; outer frames are left out beyond it."""
MAX_CAUSES = 3
"""The most errors of a chain kept below the error raised (its cause, that one's cause...)."""
_MAX_FILE = 240
_MAX_FUNCTION = 120
_MAX_SOURCE = 240


@dataclass(frozen=True)
class Frame:
    """One frame of a handler's error: where (file, line, function) and the code at that line."""

    file: str
    line: int
    function: str
    source: str = ""

    def document(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "function": self.function, "source": self.source}


def _cut(text: str, most: int, *, keep_end: bool = False) -> str:
    if len(text) <= most:
        return text
    return "…" + text[-(most - 1):] if keep_end else text[: most - 1] + "…"


def bounded(frames: list[Frame], most: int = MAX_FRAMES, most_bytes: int = MAX_FRAMES_BYTES,
            ) -> tuple[tuple[Frame, ...], int]:
    """The innermost frames within `most` frames and `most_bytes` (each text cut to a line's worth; a file
    keeps its end), and how many outer frames were left out."""
    kept = [Frame(_cut(f.file, _MAX_FILE, keep_end=True), f.line, _cut(f.function, _MAX_FUNCTION),
                  _cut(f.source, _MAX_SOURCE)) for f in frames[max(len(frames) - most, 0):]]
    size = 2
    first = len(kept)
    while first > 0:
        size += _size(kept[first - 1])
        if size > most_bytes:
            break
        first -= 1
    kept = kept[first:]
    return tuple(kept), len(frames) - len(kept)


def _size(frame: Frame) -> int:
    return len(json.dumps(frame.document(), ensure_ascii=False).encode()) + 1


def frames_bytes(frames: tuple[Frame, ...]) -> int:
    """What `frames` take of `MAX_FRAMES_BYTES` (as `bounded` counts)."""
    return 2 + sum(_size(f) for f in frames)


def frames_document(frames: tuple[Frame, ...], omitted: int, cause: dict[str, Any] | None = None) -> dict[str, Any]:
    """The keys a failure gains for its frames and its cause: none when there are none (older rows look the
    same)."""
    if not frames:
        return {}
    return {"frames": [f.document() for f in frames], **({"frames_omitted": omitted} if omitted else {}),
            **({"cause": cause} if cause is not None else {})}


_NESTED = ("error", "last_error")
"""Where a compensation's failure sits inside a history entry's data or an instance's error."""


def without_frames(error: Any) -> Any:
    """A failure (or any history entry's data) without its frames, nested ones included, for a view that
    shows them as a traceback of their own (`traceback_text`)."""
    if not isinstance(error, dict):
        return error
    gone = ("frames", "frames_omitted", "cause") if "frames" in error else ()  # a failure's cause goes with them
    return {k: without_frames(v) if k in _NESTED else v for k, v in error.items() if k not in gone}


def _with_frames(error: Any) -> dict[str, Any] | None:
    """The failure in `error` that has frames: itself, or a compensation's failure inside it."""
    for failure in (error, *(error.get(k) for k in _NESTED)) if isinstance(error, dict) else ():
        if isinstance(failure, dict) and isinstance(failure.get("frames"), list) and failure["frames"]:
            return failure
    return None


def traceback_text(error: Any) -> str | None:
    """A stored failure as Python prints a traceback (`Traceback (most recent call last):`, each frame's
    `File "...", line N, in function` and its source line, then `Type: message`), its cause's printed first
    as Python prints a chain; None when it has no frames (an older row, or a failure no handler raised).
    A compensation's failure inside `error` is found."""
    error = _with_frames(error)
    if error is None:
        return None
    return "\n".join(_chained(error, MAX_CAUSES + 1))


_LINKS = {False: "The above exception was the direct cause of the following exception:",
          True: "During handling of the above exception, another exception occurred:"}


def _chained(error: dict[str, Any], links: int) -> list[str]:
    cause = error.get("cause")
    before: list[str] = []
    if isinstance(cause, dict) and links > 1:
        before = [*_chained(cause, links - 1), "", _LINKS[cause.get("context") is True], ""]
    lines = []
    omitted = error.get("frames_omitted")
    frames = error.get("frames")
    frames = frames if isinstance(frames, list) else []
    if frames or omitted:
        lines.append("Traceback (most recent call last):")
    if isinstance(omitted, int) and omitted > 0:
        lines.append(f"  ... {omitted} outer frame{'s' if omitted != 1 else ''} not kept")
    for frame in frames:
        if not isinstance(frame, dict):
            continue
        lines.append(f'  File "{frame.get("file")}", line {frame.get("line")}, in {frame.get("function")}')
        if frame.get("source"):
            lines.append(f"    {frame['source']}")
    message = error.get("message")
    lines.append(f"{error.get('type')}: {message}" if message else str(error.get("type")))
    return before + lines
