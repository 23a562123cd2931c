"""Size and depth bounds checked before a payload or a state is stored."""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stepstone.core.bounds import check_count


class PayloadRejected(ValueError):
    """A value that may not be stored; `reason` is one of too_large, too_deep, invalid."""

    def __init__(self, what: str, reason: str, detail: str) -> None:
        super().__init__(f"{what}: {detail}")
        self.what = what
        self.reason = reason


_CONTAINERS = (dict, list)  # a tuple: `dict | list` would build a union per check

MAX_INT4 = 2**31 - 1
"""The largest value of an integer column (a version, a limit, a priority)."""
MAX_INT8 = 2**63 - 1
"""The largest value of a bigint column (an outbox event's id, a sequence number)."""
MAX_INDEXED_NAME = 500
"""Characters of a name an instance's state gives that an index holds (a task's assignee, owner and
candidates, a message wait's correlation key): PostgreSQL refuses an index entry past a third of a page
(about 2,700 bytes), which a longer name (up to four bytes a character) could be. Without the check the
commit that stored one failed on every claim until the instance was dead-lettered."""


@dataclass(frozen=True)
class Limits:
    """Configurable bounds; the defaults suit business state, not blobs."""

    max_payload_bytes: int = 256 * 1024
    max_depth: int = 32
    max_name_length: int = 200
    max_events_per_step: int = 100
    max_commit_bytes: int = 1024 * 1024
    """The state and the events one step leaves, together (each is also bound by max_payload_bytes)."""
    max_text_length: int = 2000  # free text such as a cancel reason

    def __post_init__(self) -> None:
        # A name goes into indexes (a business key, a message's correlation key): no longer than one holds.
        check_count("Limits", "max_name_length", self.max_name_length, 1, MAX_INDEXED_NAME)
        for what in ("max_payload_bytes", "max_depth", "max_events_per_step", "max_commit_bytes", "max_text_length"):
            check_count("Limits", what, getattr(self, what), 1, MAX_INT4)

    def encode(self, what: str, value: Any, text: str | None = None) -> str:
        """JSON text of `value`, or PayloadRejected when it is deep, large or not JSON. `text`, when the
        caller has it already (a state model's own JSON of `value`), is checked instead of encoding again."""
        self.check_depth(what, value)
        if text is None:
            try:
                text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            except (TypeError, ValueError) as exc:
                raise PayloadRejected(what, "invalid", f"not JSON-serializable ({exc})") from None
        if "\\u0000" in text:
            raise PayloadRejected(what, "invalid", "contains a NUL character (\\u0000), which PostgreSQL cannot store")
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise PayloadRejected(what, "invalid", "contains a lone surrogate, which is not valid UTF-8") from None
        if size > self.max_payload_bytes:
            raise PayloadRejected(
                what, "too_large", f"{size} bytes exceeds the limit of {self.max_payload_bytes} bytes"
            )
        return text

    def check_depth(self, what: str, value: Any) -> None:
        # Iterative, so a 10,000-deep document cannot exhaust the Python stack. The loops over a
        # container's members run in C (map, set, max): a map's state holds thousands of scalars, and a
        # Python loop over each cost 14% of a worker's time in a map of 1,500 items.
        stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, _CONTAINERS) else []
        while stack:  # containers only
            item, depth = stack.pop()
            if depth > self.max_depth:
                raise PayloadRejected(what, "too_deep", f"nesting deeper than the limit of {self.max_depth} levels")
            if isinstance(item, dict):
                if item and max(map(len, map(str, item))) > self.max_name_length:
                    for key in item:
                        self.check_name(f"{what} key", str(key))
                members: Any = item.values()
            else:
                members = item
            if any(issubclass(kind, _CONTAINERS) for kind in set(map(type, members))):
                stack.extend((c, depth + 1) for c in members if isinstance(c, _CONTAINERS))

    def check_commit(self, what: str, size: int) -> None:
        """One step's state and events together, in bytes, against max_commit_bytes."""
        if size > self.max_commit_bytes:
            raise PayloadRejected(
                what, "too_large", f"its state and events take {size} bytes, over the limit of "
                f"{self.max_commit_bytes} bytes per step",
            )

    def check_name(self, what: str, name: str) -> None:
        if len(name) > self.max_name_length:
            raise PayloadRejected(
                what, "too_large", f"{len(name)} characters exceeds the limit of {self.max_name_length}"
            )

    def check_text(self, what: str, value: object, *, free: bool = False, empty: bool = False) -> str:
        """`value` if PostgreSQL can store it as text: a string, no NUL, no lone surrogate (which is
        also how undecodable bytes of a command line arrive), within the name limit or, when
        `free`, the free-text limit. The one check every text argument of every operation passes."""
        if not isinstance(value, str):
            raise PayloadRejected(what, "invalid", f"must be a string, got {type(value).__name__}")
        if not value and not empty:
            raise PayloadRejected(what, "invalid", "must not be empty")
        if "\x00" in value:
            raise PayloadRejected(what, "invalid", "contains a NUL character (\\x00), which PostgreSQL cannot store")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise PayloadRejected(
                what, "invalid", "contains undecodable bytes or a lone surrogate, which are not valid UTF-8"
            ) from None
        limit = self.max_text_length if free else self.max_name_length
        if len(value) > limit:
            raise PayloadRejected(what, "too_large", f"{len(value)} characters exceeds the limit of {limit}")
        return value

    def check_label(self, what: str, value: object) -> str:
        """`check_text`, and a name people type and read in tables: a scope, a token's name or group. No
        control character (a newline forged a row of `stepstone tokens list`) and no space around it
        (`--scope ' acme'` named a scope no instance is in). An instance's scope and a token's pass it alike."""
        text = self.check_text(what, value)
        if (problem := label_problem(text)) is not None:
            raise PayloadRejected(what, "invalid", problem)
        return text

    def check_texts(self, arguments: Mapping[str, object], *, free: bool = False, empty: bool = False) -> None:
        """`check_text` of each argument given (None means not given); the keyword names the argument."""
        for name, value in arguments.items():
            if value is not None:
                self.check_text(name.replace("_", " "), value, free=free, empty=empty)


DEFAULT_LIMITS = Limits()
"""The limits of a caller that sets none: one instance, since making one checks its bounds."""


def label_problem(text: str) -> str | None:
    """Why `text` is no name people type and read (`Limits.check_label`), if it is not: a control character
    or spaces around it. The names a task step reads from the state are held to it too (core.task_entering)."""
    if any(unicodedata.category(c) == "Cc" or c in "\u2028\u2029" for c in text):
        return f"contains a control character (such as a newline): {text!r}"
    if text != text.strip():
        return f"has spaces around it: {text!r}"
    return None
